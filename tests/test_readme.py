"""The README as a newcomer meets it: short, its table generated from results/, its links inside the repository,
its quick-start blocks running as pasted (embedded model), and every command it names answering `--help`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dual_cache.cli import main
from dual_cache.eval import results_table

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = sorted((ROOT / "docs").glob("*.md"))


def _python_blocks(text: str, section: str) -> list[str]:
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", body, flags=re.S)


def test_the_readme_is_short_and_starts_with_the_two_commands():
    assert len(README.splitlines()) <= 200
    first = re.search(r"```bash\n(.*?)```", README, flags=re.S).group(1).splitlines()
    assert [line.split()[:2] for line in first] == [["make", "demo"], ["make", "test"]]


def test_the_results_table_is_what_the_report_command_prints():
    block = README.split(results_table.BEGIN, 1)[1].split(results_table.END, 1)[0].strip()
    assert block == results_table.render(str(ROOT / "results"))


@pytest.mark.parametrize("page", [ROOT / "README.md", ROOT / "results" / "README.md", *DOCS],
                         ids=lambda p: p.name)
def test_links_stay_inside_the_repository_and_resolve(page):
    text = page.read_text(encoding="utf-8")
    assert "../shared" not in text and "DESIGN.md" not in text
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if target.startswith("http"):
            continue
        assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def test_quick_start_runs_as_pasted(capsys):
    blocks = _python_blocks(README, "Quick start")
    assert len(blocks) == 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README quick start", "exec"), namespace)  # noqa: S102 - the README's own code
    printed = capsys.readouterr().out
    assert "7301" in printed  # the embedded model reads the code back
    assert namespace["cache"].stats()["device_bytes"] < namespace["cache"].stats()["dense_equivalent_bytes"]


COMMANDS = ["demo", "generate", "serve", "bench-serve", "eval", "bench", "report", "card", "export-generate",
            "bench-retrieval", "recall", "needle", "agentic", "gpu-check"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_in_the_readme_answers_help(command, capsys):
    assert f"`{command}`" in README
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    assert "usage: dual-decoder" in capsys.readouterr().out


def test_usage_examples_run_in_order_as_pasted(capsys):
    """docs/usage.md's Python blocks, one namespace, top to bottom (the OpenAI client block needs a server)."""
    text = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "openai" not in b]
    assert len(blocks) >= 3
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/usage.md", "exec"), namespace)  # noqa: S102 - the docs' own code
    assert namespace["answers"].shape[0] == 2
