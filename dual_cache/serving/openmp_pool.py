"""Release the calling thread's idle OpenMP worker threads, so that torch runs at full speed on another thread.

The scheduler runs the model on a thread of its own. PyTorch's CPU build parallelizes its operators with GNU
OpenMP (libgomp), which keeps one pool of worker threads per thread that ever started a parallel region. Once
the thread that loaded the model has its pool, a second thread running torch makes libgomp manage more threads
than there are CPUs, and libgomp then nearly stops spin-waiting between parallel regions (the libgomp manual,
`GOMP_SPINCOUNT`: with more OpenMP threads than available CPUs it spins 100 times instead of 300,000): every
operator wakes its workers through the kernel. Small operators then cost several times more on the second
thread than on the first, and a decode step of many small operators slows down as a whole (docs/serving.md
has the measurement). `omp_pause_resource_all` (an OpenMP 5.0 runtime routine) frees the caller's pool; the next
parallel region on that thread builds a new one.
"""

from __future__ import annotations

import ctypes

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep what a later region needs to restart them


def _loaded_libgomp() -> list[str]:
    """Paths of the libgomp copies mapped into this process (Linux; empty elsewhere)."""
    paths = set()
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:  # address perms offset dev inode path (the path may hold spaces)
                fields = line.rstrip("\n").split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/") and "libgomp" in fields[5].rsplit("/", 1)[-1]:
                    paths.add(fields[5])
    except OSError:
        return []
    return sorted(paths)


def release_openmp_pool() -> bool:
    """Free the OpenMP worker threads that the calling thread holds while idle (`omp_pause_resource_all`).

    It frees the calling thread's pool only: call it on the thread that ran torch's parallel operators (usually
    the main thread, which loaded the model) before another thread starts running the model. A pool held by any
    other live thread that ran parallel torch operators still slows the other thread, and nothing can free it from
    here. A later parallel operator on the calling thread rebuilds its pool (and slows the other thread again), so
    the calling thread should then leave torch work to the other thread. A no-op where torch does not use GNU
    OpenMP (no libgomp mapped into the process).

    Returns:
        True when libgomp accepted the pause (also when the calling thread held no pool); False without libgomp.
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
