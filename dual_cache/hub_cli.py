"""`dual-decoder card` and `dual-decoder export-generate`: Hugging Face Hub publishing from the command line.

`add_parser(subparsers)` adds both subcommands to the `dual-decoder` parser (`dual_cache/cli.py`).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

CUSTOM_GENERATE_FILES = ("generate.py", "requirements.txt")


def custom_generate_dir() -> Path:
    """The `custom_generate/` folder shipped inside the installed `dual_cache` package.

    Its parent folder (the `dual_cache` package folder) can itself be passed as `custom_generate=`.

    Raises:
        FileNotFoundError: the package was installed without its `custom_generate` data files.
    """
    folder = Path(__file__).resolve().parent / "custom_generate"
    missing = [name for name in CUSTOM_GENERATE_FILES if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{folder} lacks {missing}: this dual-cache installation was built without its custom_generate data "
            "files; reinstall the package."
        )
    return folder


def export_custom_generate(folder: str | os.PathLike, force: bool = False) -> Path:
    """Copy the shipped `custom_generate/` (generate.py, requirements.txt) into a model repository folder.

    Each file is written through a temporary file and `os.replace`, so no file is ever half-written; other files
    already in `<folder>/custom_generate/` are left alone.

    Args:
        folder: the model repository folder (e.g. a `save_pretrained` output or a clone of a Hub repo).
        force: overwrite an existing `<folder>/custom_generate/generate.py` or `requirements.txt`.

    Returns:
        The `<folder>/custom_generate` path.

    Raises:
        FileNotFoundError: `folder` does not exist, or the package lacks its data files.
        NotADirectoryError: `folder` or `<folder>/custom_generate` is not a directory.
        FileExistsError: the files exist already and `force` is False.
    """
    source = custom_generate_dir()
    folder = Path(folder)
    if not folder.exists():
        raise FileNotFoundError(f"{folder} does not exist; pass the model repository folder (it must exist).")
    if not folder.is_dir():
        raise NotADirectoryError(f"{folder} is not a folder; pass the model repository folder.")
    target = folder / "custom_generate"
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"{target} exists and is not a folder; remove it first.")
    existing = [str(target / name) for name in CUSTOM_GENERATE_FILES if (target / name).exists()]
    if existing and not force:
        raise FileExistsError(f"{', '.join(existing)} already exist(s); pass --force to overwrite.")
    if target.resolve() == source.resolve():
        raise FileExistsError(f"{target} is the package's own custom_generate folder; choose another folder.")
    target.mkdir(exist_ok=True)
    for name in CUSTOM_GENERATE_FILES:
        handle, tmp = tempfile.mkstemp(dir=target, prefix=f".{name}.", suffix=".tmp")
        try:
            with os.fdopen(handle, "wb") as out:
                out.write((source / name).read_bytes())
            os.replace(tmp, target / name)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    return target


def cmd_export_generate(args) -> int:
    """`dual-decoder export-generate FOLDER [--force]`."""
    try:
        target = export_custom_generate(args.folder, force=args.force)
    except (OSError, FileExistsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {target / 'generate.py'} and {target / 'requirements.txt'}")
    if not (Path(args.folder) / "config.json").is_file():
        print(f"note: {args.folder} has no config.json; custom_generate is meant for a model repository folder.")
    print(f'use: model.generate(..., custom_generate="{args.folder}" or "<hub repo id>", trust_remote_code=True)')
    return 0


def cmd_card(args) -> int:
    """`dual-decoder card --results FILE --model NAME [--out README.md] [--push REPO]`.

    Every check that needs no network (repo id, offline mode, token, results, configuration, output folder)
    runs before anything is written; the cards are rendered and validated in memory, then `--out` is written
    atomically, then `--push` uploads in a single commit.
    """
    from .eval.card import hub_card
    from .eval.quality import ruler_table

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
    """Add the `card` and `export-generate` subcommands to the `dual-decoder` parser's subparsers."""
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

    export = subparsers.add_parser(
        "export-generate", help="copy the custom_generate/ folder into a model repository folder",
        description="Copy dual-cache's custom_generate/ (generate.py, requirements.txt) into FOLDER so that "
                    "generate(custom_generate=<repo>, trust_remote_code=True) decodes with the dual cache.",
    )
    export.add_argument("folder", help="model repository folder (must exist)")
    export.add_argument("--force", action="store_true", help="overwrite an existing custom_generate/ there")
    export.set_defaults(func=cmd_export_generate)
