"""`serving/openmp_pool.release_openmp_pool`: frees the caller's idle OpenMP threads and leaves torch working."""

import os
import threading
import time

import pytest
import torch

from dual_cache.serving.openmp_pool import _loaded_libgomp, release_openmp_pool


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not _loaded_libgomp() or torch.get_num_threads() < 2,
                    reason="torch runs here without GNU OpenMP worker threads: nothing to release")
def test_release_frees_the_callers_pool_and_torch_still_computes_on_both_threads():
    gen = torch.Generator().manual_seed(20261204)
    a, b = torch.randn(257, 301, generator=gen), torch.randn(301, 263, generator=gen)
    expected = (a.double() @ b.double()).float()
    torch.mm(a, b)  # a parallel operator on this thread: it holds a pool of worker threads now
    before = _os_threads()
    assert release_openmp_pool()
    deadline = time.monotonic() + 5  # the released workers exit on their own
    while _os_threads() >= before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _os_threads() < before
    out = {}
    worker = threading.Thread(target=lambda: out.update(mm=torch.mm(a, b), total=a.sum()))
    worker.start()
    worker.join()
    torch.testing.assert_close(out["mm"], expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out["total"], a.double().sum().float())
    torch.testing.assert_close(torch.mm(a, b), expected, rtol=1e-4, atol=1e-4)  # this thread rebuilds its pool


def test_libgomp_paths_with_spaces_are_found(tmp_path, monkeypatch):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 42     /opt/my env/lib/libgomp.so.1\n"
                    "7f01-7f02 r-xp 00000000 08:01 43     /usr/lib/libc.so.6\n"
                    "7f02-7f03 rw-p 00000000 00:00 0 \n", encoding="utf-8")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(maps if path == "/proc/self/maps" else path,
                                                                           *a, **k))
    assert _loaded_libgomp() == ["/opt/my env/lib/libgomp.so.1"]
