"""Release the calling thread's idle OpenMP worker threads, so that torch runs at full speed on another thread.

The scheduler runs the model on a thread of its own. PyTorch's CPU build parallelizes its operators with GNU
OpenMP (libgomp), which keeps one pool of worker threads per thread that ever started a parallel region. Once
the thread that loaded the model has its pool, a second thread running torch makes libgomp manage more threads
than there are CPUs, and libgomp then stops spin-waiting between parallel regions (the libgomp manual,
`GOMP_SPINCOUNT`: with more OpenMP threads than available CPUs it spins 100 times instead of 300,000): every
operator wakes its workers through the kernel. Small operators then cost several times more on the second
thread than on the first, and a decode step of many small operators slows down as a whole (docs/serving.md
has the measurement). `omp_pause_resource_all` (OpenMP 5.0, §3.2.44) frees the caller's pool; the next parallel
region on that thread builds a new one.
"""

from __future__ import annotations

import ctypes

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep what a later region needs to restart them


def _loaded_libgomp() -> list[str]:
    """Paths of the libgomp copies mapped into this process (Linux; empty elsewhere)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line.rsplit("/", 1)[-1]}
    except OSError:
        return []
    return sorted(p for p in paths if p.startswith("/"))


def release_openmp_pool() -> bool:
    """Free the OpenMP worker threads that the calling thread holds while idle (`omp_pause_resource_all`).

    Call it on the thread that loaded the model, before another thread starts running it; it is a no-op where
    torch is not built with GNU OpenMP. A later parallel region on the calling thread rebuilds its pool (and
    slows the other thread again), so the calling thread should then leave torch work to the other thread.

    Returns:
        True when a libgomp pool was released.
    """
    released = False
    for path in _loaded_libgomp():
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):  # an OpenMP runtime older than 5.0
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        released |= pause(OMP_PAUSE_SOFT) == 0
    return released
