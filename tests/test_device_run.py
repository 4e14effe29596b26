"""`eval/device_run.sh` (the CUDA test machine's one call) in its dry-run mode on CPU, in that machine's layout: a
clean copy of the tree (the files the device tool carries: tracked, and untracked but not ignored), dual-cache
installed from it with --no-deps into a target folder, the stages run outside the repository root with only that
folder and the test environment's packages on the path (no editable install hook). So an import that works only in
a development install fails here, as it would there.

By default the set-up and its preflight (every stage's module imported as the stages import it), and the negative
control: run from the repository root, `python -m` imports ./dual_cache, which has no `eval` subpackage, and the
preflight fails. The whole dry run (every stage with tiny shapes, a few minutes on 2 cores) is slow-marked."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """The tree as the device tool carries it: tracked files and untracked ones git does not ignore."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"needs a git checkout to copy the tree as the device tool does ({error})")
    copy = tmp_path_factory.mktemp("device-tree")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the working tree is not carried
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    return copy


def _dry_run(tree: Path, out: Path, **environment) -> tuple[int, str]:
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(out), "PYTHON": sys.executable, **environment}
    env.pop("PYTHONPATH", None)
    result = subprocess.run(["bash", "eval/device_run.sh"], cwd=tree, env=env, capture_output=True, text=True,
                            timeout=1800)
    return result.returncode, (out / "log.txt").read_text()


def test_the_set_up_installs_and_imports_every_stage_in_the_device_layout(tree, tmp_path):
    code, log = _dry_run(tree, tmp_path, STAGES="none")
    assert code == 0, log[-3000:]
    assert "default selector" in log and "native selection engine:" in log and "== set-up done" in log
    assert not (tree / "build").exists()  # installed from a copy: nothing built in the tree


def test_the_set_up_fails_when_the_stages_run_from_the_repository_root(tree, tmp_path):
    """Where the script ran its stages before issue 54: `./dual_cache` shadows the install and lacks `eval`."""
    code, log = _dry_run(tree, tmp_path, STAGES="none", RUN_DIR=str(tree))
    assert code == 2, log[-3000:]
    assert "No module named 'dual_cache.eval'" in log and "preflight failed" in log


@pytest.mark.slow
def test_every_stage_of_the_device_script_runs_on_cpu(tree, tmp_path):
    code, log = _dry_run(tree, tmp_path, TOTAL_S="900")
    assert code == 0, log[-3000:]
    exits = dict(re.findall(r"== (\w+)\. .*?: exit (\d+)", log))
    assert set(exits) == {"2", "3a", "1a", "4", "5", "1b", "3b"}, log[-3000:]
    assert exits["1b"] == "2" and "needs a CUDA GPU" in log  # the kernel benchmark needs CUDA
    assert all(code == "0" for stage, code in exits.items() if stage != "1b"), exits
    checks = json.loads((tmp_path / "gpu_check.json").read_text())["checks"]
    assert len(checks) == 4 and all(check["passed"] for check in checks)
    assert log.count("[PASS]") == 4  # each verdict in the log
    for folder in ("cap24-32k", "cap24-128k", "latency-32k"):
        summary = json.loads((tmp_path / folder / "summary.json").read_text())
        assert summary["cells"], folder
    assert json.loads((tmp_path / "latency-32k" / "summary.json").read_text())["max_batch"] == []
    assert log.count("| method | context | batch |") >= 3  # every benchmark's table is in the log
    assert (tmp_path / "host-retrieval-32k.json").exists()
    returned = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert len(returned) <= 8, returned  # the CUDA test machine returns 8 files at most
