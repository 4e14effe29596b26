"""`dual-decoder serve`: load a model and run the OpenAI-compatible server (`server.py`) until SIGINT / SIGTERM."""

from __future__ import annotations

import argparse

from ..config import DualDecoderConfig
from ..extras import require
from ..help_format import DefaultsHelpFormatter
from ..models import NAMED_MODELS


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
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    require("serve", "`dual-decoder serve`")
    import uvicorn

    from ..models import load_model, model_display_name
    from .scheduler import Scheduler
    from .server import create_app

    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}.")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}.")
    if args.prefix_block < 0:
        raise ValueError(f"--prefix-block must be >= 0 (0: off), got {args.prefix_block}.")
    model, tokenizer = load_model(args.model)
    scheduler = Scheduler(model, tokenizer, cache_config=args.cache_config or DualDecoderConfig(), dense=args.dense,
                          max_batch=args.max_batch, max_host_bytes=args.max_host_bytes,
                          prefix_block=args.prefix_block)
    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # SIGINT / SIGTERM: running requests end after their step,
            scheduler.cancel_all()  # so their connections close and uvicorn's graceful shutdown does not wait
            super().handle_exit(sig, frame)

    app = create_app(scheduler, tokenizer, model_display_name(args.model))
    try:
        Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info")).run()
    finally:
        scheduler.stop()
    return 0
