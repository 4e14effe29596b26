"""`dual-decoder card`: a model card with dual-cache evaluation results (model-index), rendered offline and written to a
file or pushed to a Hugging Face Hub model repository (`hub_card.py` renders it; RULER's table from `ruler_table`).

`add_parser(subparsers)` adds the subcommand to the `dual-decoder` parser (registered in pyproject's
`dual_cache.commands` entry points).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def cmd_card(args) -> int:
    """`dual-decoder card --results FILE --model NAME [--out README.md] [--push REPO]`.

    Every check that needs no network (repo id, offline mode, token, results, configuration, output folder)
    runs before anything is written; the cards are rendered and validated in memory, then `--out` is written
    atomically, then `--push` uploads in a single commit.
    """
    from ..quality import ruler_table
    from . import hub_card

    token = None
    try:
        if args.push:
            token = hub_card.check_push_possible(args.push)
        if args.out and not Path(args.out).resolve().parent.is_dir():
            raise ValueError(f"--out {args.out}: folder {Path(args.out).resolve().parent} does not exist.")
        if args.out and Path(args.out).is_dir():
            raise ValueError(f"--out {args.out} is a folder; pass a file path such as {Path(args.out) / 'README.md'}.")
        cache_config = hub_card.parse_cache_config(args.cache_config)
        rows = hub_card.load_results(args.results)
        results = hub_card.aggregate(rows, model=args.results_model)
        if args.cache_config is None:  # what the harness recorded on its dual rows
            cache_config = hub_card.cache_config_from_rows(rows, model=args.results_model)
        repo_id = args.push or args.model
        existing = Path(args.out).read_text(encoding="utf-8") if args.out and Path(args.out).is_file() else None
        mine = [r for r in rows if args.results_model is None or r.get("model") == args.results_model]
        ruler = ruler_table.markdown(mine, level=3)  # the full RULER table, with intervals, under the results
        local = hub_card.render_card(results, args.model, cache_config, repo_id=repo_id, existing=existing,
                                     license=args.license, extra=ruler)
    except (ValueError, OSError, hub_card.PushError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    remote = None
    if args.push:
        try:
            remote_text = hub_card.fetch_existing_card(args.push, token)
            remote = hub_card.render_card(results, args.model, cache_config, repo_id=repo_id, existing=remote_text,
                                          license=args.license, extra=ruler)
        except (ValueError, hub_card.PushError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
    if args.out:
        try:
            hub_card.write_card_atomic(local, args.out)
        except OSError as error:
            print(f"error: cannot write {args.out}: {error}", file=sys.stderr)
            return 1
        print(f"wrote {args.out} ({len(results)} result rows)")
    elif not args.push:
        print(str(local))
    if remote is not None:
        try:
            url = hub_card.push_card(remote, args.push, token)
        except hub_card.PushError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        print(f"pushed README.md to {args.push}: {url}")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add the `card` subcommand to the `dual-decoder` parser's subparsers."""
    card = subparsers.add_parser(
        "card", help="render a model card section with dual-cache evaluation results (model-index)",
        description="Render a model card with a usage snippet, the dual configuration used and the evaluation "
                    "results as model-index entries (huggingface_hub card classes), validated offline.",
    )
    card.add_argument("--results", required=True, help="evaluation results: per-sample JSONL or a JSON summary")
    card.add_argument("--model", required=True, help="the evaluated model's Hub id (model-index name, usage snippet)")
    card.add_argument("--out", default=None, help="write the card here (an existing card is updated in place); "
                                                  "default: print it unless --push")
    card.add_argument("--push", default=None, metavar="REPO", help="update README.md of this Hub model repo")
    card.add_argument("--results-model", default=None, help="keep only rows whose 'model' equals this")
    card.add_argument("--cache-config", default=None, help="dual cache options used, as JSON or a JSON file (default: the "
                                                               "cache_config recorded on the results' dual rows)")
    card.add_argument("--license", default=None, help="card license when the card has none, e.g. apache-2.0")
    card.set_defaults(func=cmd_card)
