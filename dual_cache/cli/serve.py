"""`dual-decoder serve`: load a model and run the OpenAI-compatible server (`server.py`) until SIGINT / SIGTERM.

Under `torchrun --nproc-per-node N` (or with `--tp N`, which starts torchrun: `launch.py`) each process serves one
tensor-parallel rank (`tp_serve.py`): rank 0 runs HTTP, every rank runs the same forwards.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys

from ..config import DualDecoderConfig
from ..model.loading import NAMED_MODELS
from ..runtime.extras import require
from .help_format import DefaultsHelpFormatter


def cache_config(text: str) -> DualDecoderConfig:
    """`--cache-config` (argparse type): `DualDecoderConfig.from_json`, its errors as argparse's."""
    try:
        return DualDecoderConfig.from_json(text)
    except (TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_parser(sub) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server over the dual cache",
                           description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics "
                                       "over the dual cache until SIGINT / SIGTERM (docs/serving.md).",
                           formatter_class=DefaultsHelpFormatter)
    serve.add_argument("--model", default=None,
                       help=f"named model ({', '.join(NAMED_MODELS)}), .gguf file, local folder or Hub id "
                            "(default: the embedded smollm2-135m)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    serve.add_argument("--cache-config", type=cache_config, default=None,
                       help="DualDecoderConfig fields as JSON, or a JSON file, e.g. '{\"budget\": 512}' (default: "
                            "DualDecoderConfig's defaults, docs/usage.md)")
    serve.add_argument("--max-batch", type=int, default=8, help="requests prefilling or decoding at once")
    serve.add_argument("--max-host-bytes", type=int, default=None,
                       help="host bytes for running requests, idle sessions and cached prefixes (default: what "
                            "each cache finds available)")
    serve.add_argument("--prefix-block", type=int, default=0,
                       help="tokens per block of the prefix cache: a prompt starting with the whole blocks of an "
                            "earlier one copies that prefix instead of prefilling it; 0: off (docs/serving.md)")
    serve.add_argument("--dense", action="store_true", help="serve with the default DynamicCache instead")
    serve.add_argument("--tp", type=int, default=1,
                       help="tensor-parallel ranks on this host: starts them with torchrun (one process per GPU; "
                            "under torchrun, the expected world size). Rank 0 serves HTTP (docs/serving.md)")
    serve.add_argument("--tp-timeout", type=float, default=1800.0,
                       help="seconds a tensor-parallel collective waits for the slowest rank before the server stops "
                            "(a rank that dies stops the others at once)")
    serve.set_defaults(func=cmd_serve)


def serve_arguments(args) -> list[str]:
    """The command-line arguments of `serve` that reproduce `args` (the ranks `--tp` starts get them)."""
    out = ["--host", args.host, "--port", str(args.port), "--max-batch", str(args.max_batch),
           "--prefix-block", str(args.prefix_block), "--tp", str(args.tp), "--tp-timeout", str(args.tp_timeout)]
    if args.model is not None:
        out += ["--model", args.model]
    if args.cache_config is not None:
        out += ["--cache-config", json.dumps(dataclasses.asdict(args.cache_config))]
    if args.max_host_bytes is not None:
        out += ["--max-host-bytes", str(args.max_host_bytes)]
    if args.dense:
        out.append("--dense")
    return out


def cmd_serve(args) -> int:
    require("serve", "`dual-decoder serve`")
    from ..model.loading import load_model, model_display_name
    from ..serving.scheduler import Scheduler
    from ..serving.server import run_http

    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}.")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}.")
    if args.prefix_block < 0:
        raise ValueError(f"--prefix-block must be >= 0 (0: off), got {args.prefix_block}.")
    if args.max_host_bytes is not None and args.max_host_bytes < 1:
        raise ValueError(f"--max-host-bytes must be >= 1 (or left out: what each cache finds available), got "
                         f"{args.max_host_bytes}.")
    if args.tp < 1:
        raise ValueError(f"--tp must be >= 1, got {args.tp}.")
    if not args.tp_timeout > 0:
        raise ValueError(f"--tp-timeout must be > 0 seconds, got {args.tp_timeout}.")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp > 1 and "WORLD_SIZE" not in os.environ:  # start the ranks
        from ..serving.launch import launch

        return launch(args.tp, serve_arguments(args))
    if world > 1 or args.tp > 1:  # one rank of a tensor-parallel server, under torchrun
        from ..serving.tp_serve import serve_rank

        return serve_rank(args)
    model, tokenizer = load_model(args.model)
    scheduler = Scheduler(model, tokenizer, cache_config=args.cache_config or DualDecoderConfig(), dense=args.dense,
                          max_batch=args.max_batch, max_host_bytes=args.max_host_bytes,
                          prefix_block=args.prefix_block)
    stopped_by: list[str] = []

    def stop(signum, frame) -> None:  # uvicorn raises the signal it shut down on again once it stopped: taken here,
        stopped_by.append(signal.Signals(signum).name)  # so Ctrl-C and SIGTERM end the command without a traceback
        scheduler.cancel_all()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        run_http(scheduler, tokenizer, model_display_name(args.model), args.host, args.port)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        scheduler.stop()
    metrics = scheduler.metrics()
    print(f"dual-decoder serve: stopped{' on ' + stopped_by[0] if stopped_by else ''} after {metrics['requests']} "
          f"requests ({metrics['finished']} finished, {metrics['cancelled']} cancelled)", file=sys.stderr)
    return 0
