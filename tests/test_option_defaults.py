"""One source for the method's defaults: no command-line option of the library or of the evaluation restates a
`DualDecoderConfig` default as a literal (`default=256` for `--budget`); a tool reads it from the config
(`default=DualDecoderConfig.budget`), so a changed default reaches every tool (issue 69).

Read from the source with `ast`: every `add_argument` call whose option names a config field (`--budget`,
`--n-sink`, `--prefill-chunk-size`, ...; also `--sink`, `--skip-layers` (the early layers), `--reference-budget` and a
one-value `--budgets`) and whose `default=` is a literal equal to that field's default. A literal that differs is a
tool's own choice (a sweep of budgets, a shorter window) and is allowed.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from dual_cache import DualDecoderConfig

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = (ROOT / "dual_cache", ROOT / "eval")
ALIASES = {"sink": "n_sink", "skip_layers": "early_layers", "reference_budget": "budget", "budgets": "budget"}
DEFAULTS = {field.name: field.default for field in dataclasses.fields(DualDecoderConfig)
            if field.default is not dataclasses.MISSING}


def restated(source: str) -> list[tuple[int, str, str]]:
    """`(line, option, field)` for each `add_argument` in `source` whose literal default restates a config default."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            continue
        options = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
        default = next((k.value for k in node.keywords if k.arg == "default"), None)
        if not options or default is None:
            continue
        name = options[0][2:].replace("-", "_")
        field = ALIASES.get(name, name)
        if field not in DEFAULTS:
            continue
        try:
            value = ast.literal_eval(default)
        except ValueError:
            continue  # a name or an expression: read from somewhere, not restated
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if value is not None and not isinstance(value, bool) and value == DEFAULTS[field]:
            found.append((node.lineno, options[0], field))
    return found


def test_the_scan_finds_a_restated_default_and_only_that():
    source = ('p.add_argument("--budget", type=int, default=256)\n'
              'p.add_argument("--sink", type=int, default=4, help="sink tokens")\n'
              'p.add_argument("--budgets", type=int, nargs="+", default=[256])\n'
              'p.add_argument("--window", type=int, default=DualDecoderConfig.window)\n'
              'p.add_argument("--budgets", type=int, nargs="+", default=[64, 256])\n'
              'p.add_argument("--tokens", type=int, default=256)\n'
              'p.add_argument("--window", type=int, default=8)\n')
    assert restated(source) == [(1, "--budget", "budget"), (2, "--sink", "n_sink"), (3, "--budgets", "budget")]


def test_no_tool_restates_a_config_default():
    found = [f"  {path.relative_to(ROOT)}:{line}: {option} default restates DualDecoderConfig.{field} "
             f"({DEFAULTS[field]!r})"
             for folder in FOLDERS for path in sorted(folder.rglob("*.py"))
             for line, option, field in restated(path.read_text(encoding="utf-8"))]
    assert not found, "\n".join(["options that restate the method's defaults:", *found,
                                 "read each from the config instead: default=DualDecoderConfig.<field>"])
