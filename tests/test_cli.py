"""`dual-decoder` command line: usage errors and out-of-range requests are one line on stderr, before any work."""

from __future__ import annotations

import pytest

from dual_cache import cli, models
from tests.conftest import tiny_llama


@pytest.mark.parametrize("argv", [["demo", "--tokens", "many"], ["no-such-command"], ["generate"],
                                  ["demo", "--speculator", "oracle"]])
def test_usage_errors_are_one_line(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err and "usage:" not in err


def test_demo_tokens_beyond_the_model_positions_is_refused_before_the_prompt_is_built(monkeypatch, capsys):
    model = tiny_llama(seed=1)  # 2048 positions

    def build_prompt(*args, **kwargs):
        raise AssertionError("no prompt may be built for a request past the model's positions")

    monkeypatch.setattr(models, "load_default_model", lambda: (model, None))
    monkeypatch.setattr("dual_cache.eval.needle.make_needle_prompt", build_prompt)
    assert cli.main(["demo", "--tokens", "10000000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exceed the model's 2048 positions" in err and "--tokens" in err
