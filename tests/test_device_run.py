"""`eval/device_run.sh` (the CUDA test machine's one call) runs end to end in its dry-run mode on CPU with tiny shapes,
so its command lines cannot rot between the rare runs on a GPU (slow: a few minutes on 2 cores)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_every_stage_of_the_device_script_runs_on_cpu(tmp_path):
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path), "PYTHON": sys.executable, "TOTAL_S": "900"}
    result = subprocess.run(["bash", "eval/device_run.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=1200)
    log = (tmp_path / "log.txt").read_text()
    assert result.returncode == 0, log[-3000:]
    exits = dict(re.findall(r"== (\w+)\. .*?: exit (\d+)", log))
    assert set(exits) == {"1a", "1b", "2", "3a", "3b", "5", "4"}, log[-3000:]
    assert exits["1b"] == "2" and "needs a CUDA GPU" in log  # the kernel benchmark needs CUDA
    assert all(code == "0" for stage, code in exits.items() if stage != "1b"), exits
    checks = json.loads((tmp_path / "gpu_check.json").read_text())["checks"]
    assert checks and all(check["passed"] for check in checks)
    for folder in ("cap24-32k", "cap24-128k", "latency-32k"):
        assert (tmp_path / folder / "summary.json").exists(), folder
    assert (tmp_path / "host-retrieval-32k.json").exists()
