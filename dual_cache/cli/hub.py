"""`dual-decoder export-generate`: the shipped `custom_generate/` folder copied into a model repository (Hugging Face
Hub publishing; the model card with evaluation results, `dual-decoder card`, is `dual_cache.eval.card.card_cli`).

`add_parser(subparsers)` adds the subcommand to the `dual-decoder` parser (`dual_cache/cli/main.py`).
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
    folder = Path(__file__).resolve().parent.parent / "custom_generate"
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


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add the `export-generate` subcommand to the `dual-decoder` parser's subparsers."""
    export = subparsers.add_parser(
        "export-generate", help="copy the custom_generate/ folder into a model repository folder",
        description="Copy dual-cache's custom_generate/ (generate.py, requirements.txt) into FOLDER so that "
                    "generate(custom_generate=<repo>, trust_remote_code=True) decodes with the dual cache.",
    )
    export.add_argument("folder", help="model repository folder (must exist)")
    export.add_argument("--force", action="store_true", help="overwrite an existing custom_generate/ there")
    export.set_defaults(func=cmd_export_generate)
