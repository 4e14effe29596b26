"""docs/architecture.md's module list names every module of the library, and only modules that exist (issue 55).

The list is the "## Modules" section: one table row per module, its path in backticks relative to the repository
root (`dual_cache/cache/cache.py`, `dual_cache/serving/scheduler.py`, ...) and its one job. A module added, moved or
deleted without the list following fails here with the paths to add or remove.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"


def library_modules() -> set[str]:
    """Every Python module under dual_cache/ (package __init__ files included), as repository-relative paths."""
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / "dual_cache").rglob("*.py")
            if "__pycache__" not in p.parts}


def listed_modules() -> set[str]:
    text = DOC.read_text()
    match = re.search(r"^## Modules\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert match, "docs/architecture.md has no '## Modules' section (one table row per module of dual_cache/)"
    rows = [line for line in match.group(1).splitlines() if line.startswith("| `")]
    return {re.match(r"\| `([^`]+)`", row).group(1) for row in rows}


def test_every_module_is_listed_with_its_job():
    missing = sorted(library_modules() - listed_modules())
    assert not missing, ("docs/architecture.md's '## Modules' table lacks these modules; add a row "
                         "| `path` | its one job | for each: " + ", ".join(missing))


def test_every_listed_module_exists():
    stale = sorted(listed_modules() - library_modules())
    assert not stale, ("docs/architecture.md's '## Modules' table names modules that do not exist; "
                       "remove or rename these rows: " + ", ".join(stale))


def test_every_row_gives_a_job():
    text = DOC.read_text()
    section = re.search(r"^## Modules\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M).group(1)
    empty = [line for line in section.splitlines()
             if line.startswith("| `") and len([c for c in line.split("|")[2:] if c.strip()]) == 0]
    assert not empty, "rows without a job in docs/architecture.md's module table: " + "; ".join(empty)
