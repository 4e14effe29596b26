"""Prefill once, decode every method (eval/quality/shared_prefill.py): each method continuing the shared prefill
generates exactly the tokens of its own stand-alone `generate()` run."""

import pytest
import torch

from dual_cache.eval.quality import harness
from dual_cache.eval.quality.generation import generate
from dual_cache.eval.quality.methods import parse_method
from dual_cache.eval.quality.shared_prefill import SharedPrefill
from tests.conftest import tiny_gemma3, tiny_llama
from tests.test_eval_support import char_tokenizer, tiny_model

# the decode-time methods of the RULER table, at budgets below the prompt so selection really chooses
SPECS = ["dense", "dual@16", "oracle@16", "quest@32", "streaming@16"]
MORE_SPECS = ["dual@64", "dual-exact@16", "streaming", "dual-no-repair@16", "dual-none@16"]


def _check_methods(build, chunk, specs, tokens=200, new=12):
    model, tok = build(0), char_tokenizer()
    ids = torch.randint(3, 96, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    with SharedPrefill(model, ids, new, chunk=chunk) as shared:
        for spec in specs:
            method = parse_method(spec, 16)
            alone = generate(model, tok, ids, method, new, min_new_tokens=new)
            cache = shared.cache_for(method)
            continued = generate(model, tok, ids, method, new, cache=cache, min_new_tokens=new)
            assert continued.new_ids == alone.new_ids, spec
            assert continued.device_bytes == alone.device_bytes, spec
            if method.cache_config is not None:
                assert cache.closed  # the call closed the cache it was given
        assert shared.prefix.get_seq_length() == len(ids) - 1  # untouched by the methods' copies


@pytest.mark.parametrize("build, chunk", [(tiny_llama, 4096), (tiny_gemma3, 64)], ids=["llama", "gemma3-chunked"])
def test_each_method_generates_its_stand_alone_tokens(build, chunk):
    _check_methods(build, chunk, SPECS)


@pytest.mark.slow
@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
@pytest.mark.parametrize("chunk", [4096, 96], ids=["one-pass", "chunked"])
def test_every_method_longer_prompt(build, chunk):
    _check_methods(build, chunk, SPECS + MORE_SPECS, tokens=300, new=24)


def test_harness_rows_equal_with_and_without_shared_prefill(tmp_path):
    model, tok = tiny_model(seed=3), char_tokenizer()
    items = harness.ruler_items(tok, ["niah_single_1", "niah_multikey_2"], [1000], 1, max_new_tokens=4)
    methods = [parse_method(s, 32) for s in ("dense", "dual@32", "streaming@32")]
    shared = harness.run(model, tok, methods, str(tmp_path / "a.jsonl"), "tiny", items, progress=False)
    alone = harness.run(model, tok, methods, str(tmp_path / "b.jsonl"), "tiny", items, progress=False,
                        shared_prefill=False)
    assert len(shared) == len(alone) == len(items) * len(methods)
    for a, b in zip(shared, alone):
        assert (a["task"], a["method"], a["budget"]) == (b["task"], b["method"], b["budget"])
        assert (a["prediction"], a["score"], a["device_bytes"]) == (b["prediction"], b["score"], b["device_bytes"])
        assert a["prefill_seconds"] > 0 and b["prefill_seconds"] is None


def test_streaming_at_a_budget_keeps_as_many_entries_as_dual():
    method = parse_method("streaming@256", 256)
    assert method.budget == 256 and method.label == "streaming@256"
    assert method.cache_config == {"budget": 0, "early_layers": 0, "speculator": "none", "window": 64 + 256}
    assert parse_method("streaming", 256).cache_config["budget"] == 0 and parse_method("streaming", 256).budget == 0


def test_refuses_a_one_token_prompt():
    with pytest.raises(ValueError, match="at least 2 tokens"):
        SharedPrefill(tiny_llama(0), [5], 4)


@pytest.mark.slow
def test_embedded_model_ruler_prompt(embedded):
    """A real 1K RULER prompt on the embedded model: dense, dual, Quest, oracle and streaming continue the shared
    prefill to the tokens of their stand-alone runs."""
    model, tok = embedded
    from dual_cache.eval.quality.chat_format import prompt_format

    item = harness.ruler_items(tok, ["niah_multikey_1"], [1024], 1, fmt=prompt_format(tok, "auto", None))[0]
    with SharedPrefill(model, item.input_ids, 12) as shared:
        for spec in ("dense", "dual@64", "quest@64", "oracle@64", "streaming@64"):
            method = parse_method(spec, 64)
            alone = generate(model, tok, item.input_ids, method, 12)
            continued = generate(model, tok, item.input_ids, method, 12, cache=shared.cache_for(method))
            assert continued.new_ids == alone.new_ids, spec
