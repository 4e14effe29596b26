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
    monkeypatch.setattr("dual_cache.eval.quality.needle.make_needle_prompt", build_prompt)
    assert cli.main(["demo", "--tokens", "10000000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exceed the model's 2048 positions" in err and "--tokens" in err


@pytest.mark.parametrize("command", [["serve"], ["generate"], ["eval", "run"], ["bench-retrieval"], ["needle"]])
def test_help_shows_defaults_without_noise(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # one line per option
    with pytest.raises(SystemExit):
        cli.main([*command, "--help"])
    out = capsys.readouterr().out
    assert "(default: None)" not in out and "(default: False)" not in out and "DualDecoderConfig(" not in out
    expected = {"serve": "(default: 8000)", "generate": "(default: 256)",
                "eval": "(default: eval-results/results.jsonl)",
                "bench-retrieval": "(default: [32768, 131072])", "needle": "(default: 4096)"}[command[0]]
    assert expected in out


@pytest.mark.parametrize("model, message", [
    ("smollm2", "did you mean 'smollm2-135m'"),
    ("./no-such-file.gguf", "No .gguf file at ./no-such-file.gguf"),
])
def test_a_wrong_model_name_is_one_line_naming_what_to_give(model, message, capsys):
    assert cli.main(["generate", "--prompt-file", "README.md", "--question", "q", "--model", model]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_a_cache_config_that_is_not_a_mapping_is_refused():
    from dual_cache import DualDecoderConfig

    with pytest.raises(ValueError, match="cache_config must be a dict"):
        DualDecoderConfig.from_dict(256)


def test_an_out_of_range_option_is_named_by_its_flag(capsys):
    assert cli.main(["generate", "--prompt-file", "README.md", "--question", "q", "--n-sink", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --n-sink")
