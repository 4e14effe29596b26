"""Where a tool's output goes, and writing its result rows and markdown table next to each other (`<out>.json[l]`
and `<out>.md`).

A tool writes under the git-ignored `OUTPUT_DIR` unless its `--out` names another place, so a run never overwrites
the project's own record in `results/` (written only with an explicit `--out results/...`).
"""

from __future__ import annotations

import glob
import json
import math
import os
import time

OUTPUT_DIR = "eval-results"  # git-ignored (.gitignore); `dual-decoder eval run` writes here too


def default_out(tool: str, name: str = "") -> str:
    """A new output path for one run of `tool`: `eval-results/<tool>/<name->YYYYmmdd-HHMMSS`, relative to the
    current folder, with `-2`, `-3`, ... appended when a file or folder of that stem exists already (two runs in
    one second), so no run overwrites another. Creates nothing."""
    stem = os.path.join(OUTPUT_DIR, tool, (name + "-" if name else "") + time.strftime("%Y%m%d-%H%M%S"))
    path, n = stem, 1
    while glob.glob(glob.escape(path)) or glob.glob(glob.escape(path) + ".*"):
        n += 1
        path = f"{stem}-{n}"
    return path


def mib(nbytes: float | None) -> str:
    """A table cell in MiB (three significant digits; "—" for a missing or non-finite value)."""
    if nbytes is None or not math.isfinite(nbytes):
        return "—"
    return f"{nbytes / 2**20:.3g}"


def write_rows_and_table(out: str, rows: list[dict] | dict, table: str, jsonl: bool = False) -> list[str]:
    """Write `rows` to `<out>.jsonl` (one object per line) or `<out>.json` (a list, or any JSON object), and `table`
    to `<out>.md`; creates `out`'s folder. Returns the two paths."""
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    paths = [out + (".jsonl" if jsonl else ".json"), out + ".md"]
    with open(paths[0], "w", encoding="utf-8") as handle:
        if jsonl:
            handle.writelines(json.dumps(row) + "\n" for row in rows)
        else:
            json.dump(rows, handle, indent=1)
    with open(paths[1], "w", encoding="utf-8") as handle:
        handle.write(table)
    return paths
