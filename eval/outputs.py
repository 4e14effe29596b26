"""Writing a script's result rows and markdown table next to each other (`<out>.json[l]` and `<out>.md`)."""

from __future__ import annotations

import json
import math
import os


def mib(nbytes: float | None) -> str:
    """A table cell in MiB (three significant digits; "—" for a missing or non-finite value)."""
    if nbytes is None or not math.isfinite(nbytes):
        return "—"
    return f"{nbytes / 2**20:.3g}"


def write_rows_and_table(out: str, rows: list[dict], table: str, jsonl: bool = False) -> None:
    """Write `rows` to `<out>.jsonl` (one object per line) or `<out>.json` (a list), and `table` to `<out>.md`;
    creates `out`'s folder."""
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + (".jsonl" if jsonl else ".json"), "w", encoding="utf-8") as handle:
        if jsonl:
            handle.writelines(json.dumps(row) + "\n" for row in rows)
        else:
            json.dump(rows, handle, indent=1)
    with open(out + ".md", "w", encoding="utf-8") as handle:
        handle.write(table)
