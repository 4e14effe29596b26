"""The README as a newcomer meets it: short, its table generated from results/, its links inside the repository,
its quick-start blocks running as pasted (embedded model), and every command it names answering `--help`."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from dual_cache import DualDecoderConfig
from dual_cache.cli.main import main
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


def _options_table(text: str, heading: str) -> dict[str, str]:
    """`{field: default as written}` of the options table under `heading` (rows `| `a` / `b` | 1 / 2 | ... |`)."""
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    shown = {}
    for line in section.splitlines():
        if line.startswith("| `"):
            names, defaults = (cell.strip() for cell in line.split("|")[1:3])
            names = [n.strip().strip("`") for n in names.split(" / ")]
            defaults = [d.strip().strip("`") for d in defaults.split(" / ")]
            assert len(names) == len(defaults), line
            shown.update(zip(names, defaults))
    return shown


def _written(value) -> set[str]:
    """How a default may be written in a table."""
    if value is None:
        return {"auto", "90% of available"}
    if isinstance(value, str):
        return {f'"{value}"'}
    if isinstance(value, dict):
        return {json.dumps(value)}
    return {str(value)}


def test_the_options_tables_match_the_config_fields_and_defaults():
    fields = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
              for f in dataclasses.fields(DualDecoderConfig)}
    usage = _options_table((ROOT / "docs" / "usage.md").read_text(encoding="utf-8"), "## Options (`cache_config`")
    assert set(usage) == set(fields)  # docs/usage.md: every field
    readme = _options_table(README, "## Options\n")
    assert set(readme) <= set(fields) and {"budget", "selector", "speculator"} <= set(readme)
    for table in (usage, readme):
        for name, default in table.items():
            assert default in _written(fields[name]), (name, default, fields[name])


def test_the_architecture_count_is_the_full_budget_tests():
    from tests.test_architectures import ARCHITECTURES

    assert f"tested on {len(ARCHITECTURES)} architectures:\n  `tests/test_architectures.py`" in README
    assert len(set(ARCHITECTURES)) == len(ARCHITECTURES)


def test_every_ratio_range_cites_files_that_hold_its_numbers():
    """Each `a–b×` outside the generated table is followed by a parenthesis citing `results/...` files (the first
    one after it), and those files hold both numbers."""
    text = README.split(results_table.END, 1)[1]
    for match in re.finditer(r"(\d+(?:\.\d+)?)–(\d+(?:\.\d+)?)×", text):
        cited = re.search(r"\(([^()]*`results/[^()]*)\)", text[match.end():])
        assert cited, f"{match.group(0)} cites no results file"
        paths = re.findall(r"`(results/[^`]+)`", cited.group(1))
        files = [f for p in paths for f in ([ROOT / p] if (ROOT / p).is_file() else (ROOT / p).rglob("*"))]
        assert files, (match.group(0), paths)
        content = "".join(f.read_text(encoding="utf-8", errors="replace") for f in files if f.is_file())
        for number in match.groups():
            assert number in content, (match.group(0), number, paths)
