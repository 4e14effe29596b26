"""Tools never write into results/ unless --out says so: each one, run with its default output in a folder laid out
like a clone (results/ committed, the repository's .gitignore), leaves `git status` clean and its files under the
git-ignored eval-results/<tool>/. Tiny settings keep each run short; the tools that need several long generate()
calls are slow."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from dual_cache.cli.main import main
from dual_cache.eval.outputs import OUTPUT_DIR, default_out
from dual_cache.model import loading as models

ROOT = Path(__file__).resolve().parents[1]
GIT = shutil.which("git")

RUNS = {  # tool: its arguments (tiny settings; no --out)
    "bench": ["--model", "tiny", "--device", "cpu", "--methods", "dense", "dual-none", "--contexts", "40",
              "--budgets", "16", "--new-tokens", "4", "--warmup-steps", "1", "--repeats", "2"],
    "bench-retrieval": ["--contexts", "700", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--layers", "2",
                        "--distinct-layers", "1", "--repeats", "1", "--budget", "32", "--dtype", "fp32",
                        "--selectors", "exact"],
    "bench-serve": ["--requests", "2", "--context", "128", "--rate", "50", "--min-new", "2", "--max-new", "3",
                    "--max-batch", "2", "--systems", "dual"],
    "needle": ["--tokens", "256", "--seeds", "0", "--methods", "dense"],
    "recall": ["--tokens", "256", "--budget", "32", "--seeds", "0", "--queries", "2"],
    "agentic": ["--tokens", "1024", "--questions", "1", "--budget", "32"],
    "report": [],
}
SLOW = {"agentic"}


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A git repository holding the project's .gitignore and results/, all committed."""
    if GIT is None:
        pytest.skip("git is not installed")
    folder = tmp_path_factory.mktemp("clone")
    shutil.copy(ROOT / ".gitignore", folder / ".gitignore")
    shutil.copytree(ROOT / "results", folder / "results")
    for command in (["init", "-q"], ["add", "-A"],
                    ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "clone"]):
        subprocess.run([GIT, *command], cwd=folder, check=True, capture_output=True)
    return folder


@pytest.mark.parametrize("tool", [pytest.param(t, marks=pytest.mark.slow) if t in SLOW else t for t in RUNS])
def test_a_tool_run_with_its_defaults_leaves_the_clone_clean(tool, clone, embedded, monkeypatch, capsys):
    monkeypatch.chdir(clone)
    monkeypatch.setattr(models, "load_model", lambda name=None, **kwargs: embedded)  # loaded once per session
    assert main([tool, *RUNS[tool]]) == 0
    printed = capsys.readouterr().out
    status = subprocess.run([GIT, "status", "--porcelain", "--untracked-files=all"], cwd=clone, check=True,
                            capture_output=True, text=True).stdout
    assert status == "", status
    written = sorted(p for p in (clone / OUTPUT_DIR / tool).rglob("*") if p.is_file()) \
        if (clone / OUTPUT_DIR / tool).exists() else []
    if tool == "report":  # prints the table; writes only with --write / --plot
        assert "| measure |" in printed and not written
    else:
        assert written and "wrote " + OUTPUT_DIR in printed


def test_default_out_never_reuses_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = default_out("needle", "x")
    Path(first).parent.mkdir(parents=True)
    Path(first + ".md").write_text("")
    second = default_out("needle", "x")
    assert second != first and second.startswith(first) and Path(second).parts[0] == OUTPUT_DIR
