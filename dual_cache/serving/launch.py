"""`dual-decoder serve --tp N` without torchrun: start the N ranks of a tensor-parallel server on this host.

    dual-decoder serve --tp 2 --model path/to/model --port 8000

runs `python -m torch.distributed.run --standalone --nproc-per-node N -m dual_cache.cli serve ...` (the same
command line; each rank sees `WORLD_SIZE` and serves its shard, `tp_serve.py`) in a session of its own, and waits
for it. SIGINT / SIGTERM are passed to the ranks themselves, not to torchrun: every rank asks the group to stop,
the ranks stop together at their next turn boundary, and torchrun sees them all exit cleanly. If this process dies,
torchrun gets SIGTERM (Linux parent-death signal) and stops the ranks, so none is left behind.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: receive SIGTERM when the launching process dies (Linux; elsewhere a no-op)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def torchrun_command(tp: int, serve_args: list[str]) -> list[str]:
    """The torchrun command line that starts `tp` ranks of `dual-decoder serve` with `serve_args`.

    Raises:
        ValueError: `tp` < 2.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 2:
        raise ValueError(f"--tp must be an integer >= 2 to launch ranks, got {tp!r}.")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}",
            "-m", "dual_cache.cli", "serve", *serve_args]


def rank_environment(tp: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The ranks' environment: `base` (default: this process's) with `OMP_NUM_THREADS` set to this host's cores
    divided among the `tp` ranks when it is not set (torchrun would set 1)."""
    env = dict(os.environ if base is None else base)
    if "OMP_NUM_THREADS" not in env:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        env["OMP_NUM_THREADS"] = str(max(1, cores // tp))
    return env


def _children(pid: int) -> list[int]:
    """The child processes of `pid` (Linux /proc; empty where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as handle:
            return [int(p) for p in handle.read().split()]
    except (OSError, ValueError):
        return []


def launch(tp: int, serve_args: list[str]) -> int:
    """Start `tp` ranks of `dual-decoder serve serve_args` with torchrun and wait for them.

    Returns:
        torchrun's exit status (0 when every rank exited cleanly).

    Raises:
        ValueError: `tp` < 2.
    """
    command = torchrun_command(tp, serve_args)
    process = subprocess.Popen(command, env=rank_environment(tp), start_new_session=True,
                               preexec_fn=_die_with_parent)  # noqa: PLW1509 - no threads run yet

    def forward(signum, frame) -> None:  # to the ranks (torchrun's children); torchrun itself if none yet
        ranks = _children(process.pid)
        for pid in ranks or [process.pid]:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                return process.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                continue
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if process.poll() is None:  # an exception here: do not leave the ranks behind
            process.terminate()
            deadline = time.monotonic() + 30
            while process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            if process.poll() is None:
                process.kill()
