"""results/ holds data and the README of each folder, never code: the tools that write it live under eval/."""

from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
CODE_SUFFIXES = {".py", ".sh", ".cpp", ".c", ".h"}


def test_results_holds_no_code():
    code = sorted(str(path.relative_to(RESULTS)) for path in RESULTS.rglob("*") if path.suffix in CODE_SUFFIXES)
    assert not code, f"code under results/ (move it to a tool under eval/, its README naming the command): {code}"
