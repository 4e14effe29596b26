"""`serving/openmp_pool.release_openmp_pool`: frees the caller's idle OpenMP threads and leaves torch working."""

import threading

import torch

from dual_cache.serving.openmp_pool import _loaded_libgomp, release_openmp_pool


def test_release_then_torch_still_computes_on_both_threads():
    gen = torch.Generator().manual_seed(20261204)
    a, b = torch.randn(257, 301, generator=gen), torch.randn(301, 263, generator=gen)
    expected = (a.double() @ b.double()).float()
    torch.mm(a, b)  # a parallel region on this thread (where torch uses OpenMP): it holds a pool now
    assert release_openmp_pool() == bool(_loaded_libgomp())  # released wherever torch's libgomp is loaded
    out = {}
    worker = threading.Thread(target=lambda: out.update(mm=torch.mm(a, b), total=a.sum()))
    worker.start()
    worker.join()
    torch.testing.assert_close(out["mm"], expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out["total"], a.double().sum().float())
    torch.testing.assert_close(torch.mm(a, b), expected, rtol=1e-4, atol=1e-4)  # this thread rebuilds its pool
    assert release_openmp_pool() == bool(_loaded_libgomp())  # and can release it again
