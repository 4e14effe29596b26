"""`dual-decoder` command line: usage errors and out-of-range requests are one line on stderr, before any work."""

from __future__ import annotations

import pytest

from dual_cache.cli import main as cli
from dual_cache.model import loading as models
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
    monkeypatch.setattr("dual_cache.model.needle_prompt.make_needle_prompt", build_prompt)
    assert cli.main(["demo", "--tokens", "10000000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exceed the model's 2048 positions" in err and "--tokens" in err


@pytest.mark.parametrize("command", [["serve"], ["generate"], ["eval", "run"], ["bench-retrieval"], ["needle"],
                                     ["bench-serve"], ["bench"], ["agentic"], ["report"]])
def test_help_shows_defaults_without_noise(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # one line per option
    with pytest.raises(SystemExit):
        cli.main([*command, "--help"])
    out = capsys.readouterr().out
    assert "(default: None)" not in out and "(default: False)" not in out and "DualDecoderConfig(" not in out
    expected = {"serve": "(default: 8000)", "generate": "(default: 256)",
                "eval": "(default: eval-results/results.jsonl)",
                "bench-retrieval": "(default: [32768, 131072])", "needle": "(default: 4096)",
                "bench-serve": "(default: 16)", "bench": "(default: 32)", "agentic": "(default: 8192)",
                "report": "(default: results)"}[command[0]]
    assert expected in out
    assert not any(line.count("(default") > 1 for line in out.splitlines()), "a default printed twice"


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


@pytest.mark.parametrize("argv, prog", [
    (["generate", "--prompt-file", "README.md", "--question", "q", "--bogus"], "dual-decoder generate"),
    (["eval", "run", "--bogus"], "dual-decoder eval run"),
])
def test_an_unknown_option_points_to_its_own_commands_help(argv, prog, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{prog}: error: unrecognized arguments: --bogus") and f"(see {prog} --help)" in err


def test_an_empty_question_is_refused_before_the_model_loads(monkeypatch, capsys):
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("no model may load for an empty question"))
    assert cli.main(["generate", "--prompt-file", "README.md", "--question", "  "]) == 2
    assert capsys.readouterr().err.startswith("error: --question is empty")


def test_cache_config_fields_are_kept_and_the_flags_given_override_them(tmp_path):
    path = tmp_path / "cache.json"
    path.write_text('{"budget": 128, "early_layers": 0, "n_sink": 2}')
    for source in (str(path), path.read_text()):
        args = cli.build_parser().parse_args(["generate", "--prompt-file", "x", "--question", "q",
                                              "--cache-config", source, "--n-sink", "8", "--no-miss-repair"])
        config = cli._dual_config(args)
        assert (config.budget, config.early_layers, config.n_sink, config.miss_repair) == (128, 0, 8, False)
    args = cli.build_parser().parse_args(["generate", "--prompt-file", "x", "--question", "q"])
    defaults = cli._dual_config(args)
    assert defaults == cli.DualDecoderConfig()  # progress bars are the command's (`--quiet`), not the config's


@pytest.mark.parametrize("text, message", [
    ("/no/such/file.json", "neither a JSON object nor a readable file"),
    ('{"budget": 256', "not a JSON object"),
    ('{"budgte": 256}', "did you mean 'budget'"),
])
def test_a_bad_cache_config_is_one_line_saying_what_to_change(text, message, capsys):
    try:  # the text is checked when parsed (argparse exits), its fields with the flags before any work
        status = cli.main(["generate", "--prompt-file", "README.md", "--question", "q", "--cache-config", text])
    except SystemExit as exit_info:
        status = exit_info.code
    assert status == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "--cache-config" in err


def test_cache_config_and_flags_are_validated_together_and_errors_name_what_the_user_wrote():
    parse = cli.build_parser().parse_args
    base = ["generate", "--prompt-file", "x", "--question", "q", "--cache-config"]
    # a value the flag replaces is never checked on its own
    config = cli._dual_config(parse([*base, '{"budget": -1, "prefill_progress": false}', "--budget", "64"]))
    assert (config.budget, config.prefill_progress) == (64, False)
    with pytest.raises(ValueError) as error:  # from the JSON: the field's name, not a flag never given
        cli._dual_config(parse([*base, '{"lowbit_channels": 5}']))
    assert "`lowbit_channels`" in str(error.value) and "--lowbit-channels" not in str(error.value)


def test_cache_config_files_and_inline_json_that_is_not_an_object(tmp_path, capsys):
    from dual_cache import DualDecoderConfig

    bom = tmp_path / "bom.json"
    bom.write_bytes(b'\xef\xbb\xbf{"budget": 128}')
    assert DualDecoderConfig.from_json(str(bom)).budget == 128
    empty = tmp_path / "empty.json"
    empty.write_text(" \n")
    for text, message in [("[1, 2]", "must be a JSON object"), ("42", "got int"), (str(empty), "is empty"),
                          ('{"no_miss_repair": true}', "set 'miss_repair' to false")]:
        with pytest.raises(ValueError, match=message):
            DualDecoderConfig.from_json(text)


def test_a_request_past_the_host_memory_limit_is_one_line(monkeypatch, capsys):
    from dual_cache.host.memory import HostMemoryError

    def refuse(*args, **kwargs):
        raise HostMemoryError("the request needs 9 GiB of host memory, 1 B allowed (max_host_bytes); raise it")

    monkeypatch.setattr(models, "load_model", lambda *a, **k: (None, None))
    monkeypatch.setattr(cli, "run_question", refuse)
    assert cli.main(["generate", "--prompt-file", "README.md", "--question", "q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: the request needs 9 GiB")


def test_progress_bars_move_by_layer_in_a_one_chunk_prefill_and_by_token_in_decode(monkeypatch):
    """`GenerationProgress` on the dense default cache and on the dual cache: the prefill bar moves once per layer
    of every chunk (a one-chunk prompt does not sit at 0%), the decode bar once per token; its hooks are gone after."""
    import torch

    from dual_cache.runtime import progress
    from tests.conftest import tiny_llama

    model = tiny_llama()
    layers = progress.decoder_layers(model)
    assert len(layers) == model.config.num_hidden_layers
    seen = []

    class Recorder:
        def __init__(self, total=None, desc="", **kwargs):
            self.total, self.desc, self.n = total, desc, 0
            seen.append(self)

        def update(self, n=1):
            self.n += n

        def close(self):
            pass

    monkeypatch.setattr(progress, "tqdm", Recorder)
    ids = torch.randint(5, 90, (1, 40), generator=torch.Generator().manual_seed(0))
    for cache_kwargs, chunk in (({}, 40), ({"cache_implementation": "dual",
                                             "cache_config": {"budget": 8, "window": 4, "prefill_chunk_size": 16}}, 16)):
        seen.clear()
        with progress.GenerationProgress(model, 40, chunk, 5, enabled=True) as bars:
            model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, streamer=bars, **cache_kwargs)
        prefill, decode = seen
        assert prefill.total == prefill.n == -(-40 // chunk) * len(layers), (prefill.total, prefill.n)
        assert decode.total == 5 and decode.n == 5
        assert all(not layer._forward_pre_hooks for layer in layers)


def test_progress_is_shown_only_on_a_terminal_and_never_with_quiet():
    import io

    from dual_cache.runtime.progress import shown

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert shown(stream=Terminal()) and not shown(quiet=True, stream=Terminal()) and not shown(stream=io.StringIO())
