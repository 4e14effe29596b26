"""The core install and the extras (pyproject.toml, dual_cache/runtime/extras.py): `import dual_cache` and a dual
generate() pull in no extra's package; with the extras absent every command's --help still works and a command that
needs one fails with one line naming it; the wheel installs into a fresh venv holding only the core (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

import dual_cache  # noqa: E402
from dual_cache.runtime.extras import EXTRAS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tests" / "fixtures" / "core_check.py"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_the_extras_of_pyproject_are_the_extras_the_code_names():
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert set(EXTRAS) <= set(extras)
    assert extras["all"] == ["dual-cache[" + ",".join(EXTRAS) + "]"]
    core = " ".join(PYPROJECT["project"]["dependencies"])
    for packages in EXTRAS.values():
        for module in packages:
            assert module not in core
    assert PYPROJECT["project"]["dynamic"] == ["version"]  # from dual_cache.__version__ alone
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "dual_cache.__version__"}


def _report(python: str, *args: str, cwd: Path, env: dict | None = None) -> dict:
    result = subprocess.run([python, str(CHECK), *args], cwd=cwd, capture_output=True, text=True, timeout=900,
                            env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_import_and_a_dual_generate_import_no_extra(tmp_path):
    report = _report(sys.executable, cwd=tmp_path)
    assert report["equal_to_dense"]
    assert report["extras_imported"] == []


def test_without_the_extras_the_core_runs_and_commands_name_the_extra_they_need(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    helps = [["--help"], ["serve", "--help"], ["eval", "run", "--help"], ["bench", "--help"], ["needle", "--help"]]
    needs = {"serve": ["serve"], "eval": ["report", "--plot", str(tmp_path / "p.png")],
             "gguf": ["generate", "--model", str(tmp_path / "m.gguf"), "--prompt-file", str(CHECK),
                      "--question", "what?"]}
    report = _report(sys.executable, "--hide-extras", json.dumps([*helps, *needs.values(),
                                                                   ["import", "dual_cache.serving.server"],
                                                                   ["import", "dual_cache.eval.quality.ruler"]]),
                     cwd=tmp_path)
    assert report["equal_to_dense"] and report["extras_imported"] == []
    commands = report["commands"]
    assert [c["code"] for c in commands[:len(helps)]] == [0] * len(helps)
    for extra, command in zip(needs, commands[len(helps):]):
        lines = command["stderr"].strip().splitlines()
        assert command["code"] == 2 and len(lines) == 1, command
        assert f"the `{extra}` extra" in lines[0] and f"pip install 'dual-cache[{extra}]'" in lines[0]
    for command, extra in zip(commands[-2:], ("serve", "eval")):
        assert command["code"] == 3 and "MissingExtraError: " in command["stderr"], command
        assert f"`{extra}` extra" in command["stderr"]


def _venv_with_torch(folder: Path) -> str:
    """A fresh venv holding torch==2.13.0 (the local CPU wheel here); skips when pip cannot install it."""
    venv.create(folder, with_pip=True)
    python = str(folder / "bin" / "python")
    result = subprocess.run([python, "-m", "pip", "install", "-q", "torch==2.13.0"], capture_output=True, text=True,
                            timeout=900)
    if result.returncode:
        pytest.skip(f"cannot install torch==2.13.0 into a fresh venv: {result.stderr.strip()[-300:]}")
    return python


@pytest.mark.slow
def test_the_wheel_installs_the_core_alone_into_a_fresh_venv(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(wheels), str(ROOT)], check=True, capture_output=True, timeout=600)
    (wheel,) = wheels.glob("dual_cache-*.whl")
    assert wheel.name.startswith(f"dual_cache-{dual_cache.__version__}-")
    names = zipfile.ZipFile(wheel).namelist()
    assert "dual_cache/engine/selection_engine.cpp" in names  # the native engine builds on first use
    assert "dual_cache/eval/quality/ruler.py" in names and "dual_cache/serving/server.py" in names
    python = _venv_with_torch(tmp_path / "venv")
    result = subprocess.run([python, "-m", "pip", "install", "-q", str(wheel)], capture_output=True, text=True,
                            timeout=900)
    if result.returncode:
        pytest.skip(f"cannot install the wheel's dependencies: {result.stderr.strip()[-300:]}")
    installed = subprocess.run([python, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                               check=True).stdout
    names = {line.split("==")[0].lower() for line in installed.splitlines()}
    assert not names & {"fastapi", "uvicorn", "datasets", "evaluate", "matplotlib", "gguf", "accelerate", "rouge",
                        "jieba", "wonderwords"}
    engine_dir = tmp_path / "engine"
    run = tmp_path / "elsewhere"  # not the repository: the installed wheel is imported
    run.mkdir()
    report = _report(python, cwd=run, env={"DUAL_CACHE_ENGINE_DIR": str(engine_dir)})
    assert report["equal_to_dense"] and report["extras_imported"] == []
    assert report["version"] == dual_cache.__version__ and str(tmp_path / "venv") in report["file"]
    assert report["engine"] != "reference" and any(engine_dir.rglob("*.so"))  # built from the shipped source
    script = str(tmp_path / "venv" / "bin" / "dual-decoder")
    assert "usage: dual-decoder" in subprocess.run([script, "--help"], capture_output=True, text=True, cwd=run,
                                                    check=True).stdout
    serve = subprocess.run([script, "serve"], capture_output=True, text=True, cwd=run)
    assert serve.returncode == 2 and "pip install 'dual-cache[serve]'" in serve.stderr
