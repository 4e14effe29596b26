"""The needle sweep's argument parsing and report (the model run itself is the embedded anchors' job)."""

import pytest

from dual_cache.eval.quality import needle_sweep


def test_parse_seeds():
    assert needle_sweep.parse_seeds("0-3") == [0, 1, 2, 3]
    assert needle_sweep.parse_seeds("5,1") == [5, 1]
    for bad in ("", "a-b", "3-1", "-1"):
        with pytest.raises(ValueError, match="--seeds"):
            needle_sweep.parse_seeds(bad)


def test_markdown_counts_correct_answers():
    rows = [
        {"seed": 0, "answer": "1234567", "dense": True, "dense_text": "is 1234567.", "dual": True, "dual_text": "is 1234567."},
        {"seed": 1, "answer": "7654321", "dense": True, "dense_text": "is 7654321.", "dual": False, "dual_text": "is 7."},
    ]
    table = needle_sweep.markdown(rows, ["dense", "dual"], 4096, 256)
    assert "Correct: dense 2/2, dual 1/2." in table
    assert table.count("\n| ") == 3  # header + 2 rows


def test_bad_arguments_exit_2_before_loading_a_model(capsys):
    assert needle_sweep.main(["--seeds", "x"]) == 2
    assert "--seeds" in capsys.readouterr().err
    assert needle_sweep.main(["--tokens", "10"]) == 2
    for bad in ("0", "two"):
        with pytest.raises(SystemExit) as exit_info:  # argparse: exit status 2
            needle_sweep.main(["--threads", bad])
        assert exit_info.value.code == 2 and "--threads" in capsys.readouterr().err
    with pytest.raises(ValueError, match="empty"):
        needle_sweep.parse_seeds("5-2")


def test_bad_options_exit_2_before_loading_a_model(capsys):
    assert needle_sweep.main(["--options", '{"lowbit_factr": 8}']) == 2  # not a DualDecoderConfig field
    assert "--options" in capsys.readouterr().err
    assert needle_sweep.main(["--methods", "dual-lowbit", "--options", '{"lowbit_factor": 0}']) == 2  # out of range
    assert "lowbit_factor" in capsys.readouterr().err
    for bad in ("[1]", "{lowbit"):  # not a JSON object
        with pytest.raises(SystemExit) as exit_info:
            needle_sweep.main(["--options", bad])
        assert exit_info.value.code == 2 and "--options" in capsys.readouterr().err


def test_a_prompt_that_leaves_no_positions_for_the_answer_is_refused(embedded):
    model = embedded[0]
    needle_sweep.check_positions(model, 8192 - needle_sweep.NEW_TOKENS)  # the embedded model has 8,192 positions
    with pytest.raises(ValueError, match=f"8192 positions; use --tokens {8192 - needle_sweep.NEW_TOKENS}"):
        needle_sweep.check_positions(model, 8192)
