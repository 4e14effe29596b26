"""One rank of a tensor-parallel `dual-decoder serve` (run under `torchrun --nproc-per-node N`, or `--tp N`).

Every rank initialises `torch.distributed` (gloo on CPU, NCCL on CUDA), loads its shard of the model with the model's
tensor-parallel plan, and runs a `TPScheduler` (`tp_scheduler.py`). Rank 0 also runs the HTTP server; the others run
the same scheduler turns until the group stops. SIGINT / SIGTERM on any rank ask the group to stop: every rank
cancels its requests at the next turn boundary and exits 0. A rank that dies (or a collective past `--tp-timeout`)
stops the others with a log line naming it, and they exit 1: nothing waits for a rank that is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from ..config import DualDecoderConfig

LOGGER = "dual_cache"


def init_distributed(timeout_s: float) -> None:
    """Initialise the default process group from torchrun's environment (NCCL with each rank's local GPU on
    CUDA, gloo on CPU), unless it already is; collectives wait `timeout_s` seconds at most.

    Raises:
        RuntimeError: torchrun's variables (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, ...) are missing.
    """
    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        raise RuntimeError("A tensor-parallel server runs one process per rank: start it with `dual-decoder serve "
                           "--tp N` or `torchrun --nproc-per-node N -m dual_cache.cli serve ...`.")
    kwargs = {}
    backend = "gloo"
    if torch.cuda.is_available():
        backend = "nccl"
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        kwargs["device_id"] = torch.device("cuda", local)
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)


def _rank_logging(rank: int) -> logging.Logger:
    """Log lines of this package on stderr, prefixed with the rank."""
    log = logging.getLogger(LOGGER)
    if not any(getattr(h, "_dual_rank", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(message)s"))
        handler._dual_rank = True
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


def serve_rank(args) -> int:
    """Serve one rank (the `serve` command's parsed `args`); returns the exit status (0 after a stop, 1 when the
    group failed).

    Raises:
        ValueError: `--tp` differs from torchrun's world size, or the model cannot be split (uneven heads); every
            rank raises the same before serving.
    """
    from ..model.loading import load_model, model_display_name
    from .distributed import TPGroup
    from .server import run_http
    from .tp_scheduler import TPScheduler

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp > 1 and args.tp != world:
        raise ValueError(f"--tp {args.tp} but torchrun started {world} rank(s); give the same count (or drop --tp).")
    init_distributed(args.tp_timeout)
    rank = dist.get_rank()
    log = _rank_logging(rank)
    group = None
    try:
        model, tokenizer = load_model(args.model, tp_size=world)
        group = TPGroup(args.tp_timeout)
        holder: dict = {}

        def on_exit(failure: str | None) -> None:  # the loop ended: rank 0's HTTP server goes with it
            server = holder.get("server")
            if server is not None:
                server.should_exit = True

        scheduler = TPScheduler(model, tokenizer, cache_config=args.cache_config or DualDecoderConfig(),
                                dense=args.dense, max_batch=args.max_batch, max_host_bytes=args.max_host_bytes,
                                prefix_block=args.prefix_block, group=group, on_exit=on_exit)
        shard = scheduler._probe.shard if scheduler._probe is not None else None
        log.info(f"rank {rank} of {world} serving (pid {os.getpid()}, "
                 f"{shard.describe() if shard else 'dense rows'})")
        def stop(signum, frame) -> None:  # the group stops at its next turn boundary
            scheduler.cancel_all()

        for sig in (signal.SIGINT, signal.SIGTERM):  # on rank 0, uvicorn replaces them while it serves and
            signal.signal(sig, stop)  # raises the signal it caught again once it stopped: this handler takes it
        try:
            if rank == 0:
                run_http(scheduler, tokenizer, model_display_name(args.model), args.host, args.port,
                         on_server=lambda server: holder.update(server=server) if scheduler._loop.is_alive()
                         else setattr(server, "should_exit", True))
            while not scheduler.join(0.5):
                pass
        finally:
            scheduler.stop()
        metrics = scheduler.metrics()
        log.info(f"rank {rank} stopped{' after a failure' if scheduler.failure else ''}: "
                 f"{metrics['requests']} requests, {metrics['finished']} finished ({metrics['cancelled']} cancelled), "
                 f"{metrics['output_tokens']} output tokens, {scheduler.turns} turns")
        return 0 if scheduler.failure is None else 1
    finally:
        if group is not None:
            group.close()
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError):
            pass
