"""`python -m dual_cache.eval.gpu_check` end to end at toy sizes on CPU: exit status, PASS lines, the JSON."""

from __future__ import annotations

import json

from dual_cache.eval import gpu_check


def test_gpu_check_cli_on_cpu_writes_its_json(tmp_path, capsys):
    assert gpu_check.main(["--device", "cpu", "--tiny", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("[PASS]") == 4 and "default selector" in printed
    assert "no host synchronization inside a steady-state decode step" in printed
    with open(tmp_path / "gpu_check.json", encoding="utf-8") as handle:
        written = json.load(handle)
    assert written["device"] == "cpu" and len(written["checks"]) == 4 and written["selector"]


def test_gpu_check_refuses_a_full_size_run_without_cuda(capsys):
    assert gpu_check.main(["--device", "cpu"]) == 2
    assert "--tiny" in capsys.readouterr().err
