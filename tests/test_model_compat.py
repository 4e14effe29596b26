"""Models and generate() calls a user tries: each works (identical to the default cache at full budget, fp32) or
raises a clear ValueError before any forward. Tiny random-weight models built from configs (no Hub access)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from dual_cache import DualDecoderCache, DualDecoderConfig
from dual_cache.host.memory import live_host_bytes
from tests.conftest import tiny_llama

FULL = {"budget": 4096, "n_sink": 4, "window": 16}
SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=2048, eos_token_id=None, pad_token_id=0)


def _prompt(seed, length, batch=1):
    return torch.randint(3, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


def _build(config_cls, model_cls, seed=0, layers=2, **options):
    torch.manual_seed(seed)
    return model_cls(config_cls(**SMALL, num_hidden_layers=layers, **options)).eval()


def mistral(**options):
    from transformers import MistralConfig, MistralForCausalLM

    return _build(MistralConfig, MistralForCausalLM, **options)


def phi3(**options):
    from transformers import Phi3Config, Phi3ForCausalLM

    return _build(Phi3Config, Phi3ForCausalLM, **options)


def _dual(model, ids=None, **kwargs):
    """Greedy dual generate; returns (sequences, cache)."""
    out = model.generate(ids, do_sample=False, return_dict_in_generate=True, cache_implementation="dual", **kwargs)
    return out.sequences, out.cache


# --- sliding windows without layer_types --------------------------------------------------------------------------
@pytest.mark.parametrize("build", [
    lambda: mistral(),  # MistralConfig's own default window, 4096
    lambda: phi3(sliding_window=2047),  # Phi-3-mini's window
    lambda: mistral(sliding_window=141),  # a window exactly as long as the request (120 + 20 new + speculated)
])
def test_sliding_window_covering_the_request_is_full_attention(build):
    model = build()
    ids = _prompt(1, 120)
    dense = model.generate(ids, max_new_tokens=20, do_sample=False)
    dual, cache = _dual(model, ids, max_new_tokens=20, cache_config={**FULL, "prefill_chunk_size": 64})
    assert torch.equal(dense, dual)
    assert len(cache.dual_layers) == 2 and cache.stats()["host_bytes"] > 0  # served from host stores
    # a cache built by the user (request length unknown when built) decides at generate()
    explicit = DualDecoderCache(model.config, **FULL)
    assert not explicit.dual_layers
    assert torch.equal(model.generate(ids, max_new_tokens=20, do_sample=False, cache=explicit), dense)
    assert len(explicit.dual_layers) == 2


def test_every_layer_truly_sliding_decodes_like_the_default_cache():
    """A window shorter than the request: every layer slides, the dual cache keeps each window on the device
    (nothing to offload) and decodes exactly like the default cache, partial budget or not."""
    model = mistral(sliding_window=48)
    ids = _prompt(2, 100, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :30] = 0
    dense = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    for options in (FULL, {"budget": 8, "window": 4}):
        dual, cache = _dual(model, ids, attention_mask=mask, max_new_tokens=20, cache_config=options)
        assert torch.equal(dense, dual)
        assert not cache.dual_layers and cache.stats()["host_bytes"] == 0


# --- logit soft-capping (Gemma 2) ---------------------------------------------------------------------------------
@pytest.mark.parametrize("softcap", [50.0, 0.5])
def test_gemma2_logit_softcapping_matches_default_cache(softcap):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    model = _build(Gemma2Config, Gemma2ForCausalLM, seed=3, layers=4, head_dim=16, sliding_window=32,
                   attn_logit_softcapping=softcap, query_pre_attn_scalar=16)
    ids = _prompt(4, 90)
    dense = model.generate(ids, max_new_tokens=20, do_sample=False)
    dual, cache = _dual(model, ids, max_new_tokens=20, cache_config=FULL)
    assert torch.equal(dense, dual) and len(cache.dual_layers) == 2  # layers 1 and 3: full attention


def test_softcap_reaches_the_decode_attention():
    """With a tiny cap the capped and uncapped decode attention differ; full budget still equals the default
    cache, so the dual decode path applies the cap (not only the prefill)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    seen = []
    import dual_cache.layer.attention as attention

    original = attention.sparse_decode_attention

    def spy(*args, softcap=None, **kwargs):
        seen.append(softcap)
        return original(*args, softcap=softcap, **kwargs)

    model = _build(Gemma2Config, Gemma2ForCausalLM, seed=5, layers=2, head_dim=16,
                   layer_types=["full_attention"] * 2, attn_logit_softcapping=0.3)
    ids = _prompt(6, 60)
    dense = model.generate(ids, max_new_tokens=12, do_sample=False)
    attention.sparse_decode_attention = spy
    try:
        dual, _ = _dual(model, ids, max_new_tokens=12, cache_config=FULL)
    finally:
        attention.sparse_decode_attention = original
    assert torch.equal(dense, dual)
    assert seen and set(seen) == {0.3}


# --- models whose layers do not hand the cache / kwargs to attention -------------------------------------------------
def _assert_refused_before_work(model, message, **kwargs):
    threads, host = threading.active_count(), live_host_bytes()
    cache = DualDecoderCache(model.config, **FULL)
    with pytest.raises(ValueError, match=message):
        model.generate(_prompt(7, 30), max_new_tokens=4, cache=cache, **kwargs)
    assert cache.get_seq_length() == 0  # no prefill ran
    assert threading.active_count() == threads and live_host_bytes() == host


def test_stablelm_decoder_layers_dropping_kwargs_are_refused_before_any_work():
    from transformers import StableLmConfig, StableLmForCausalLM

    model = _build(StableLmConfig, StableLmForCausalLM)
    _assert_refused_before_work(model, "do not pass generate\\(\\)'s keyword arguments")


def _wrap_attention(model, change):
    for layer in model.model.layers:
        forward = layer.self_attn.forward

        def dropping(*args, forward=forward, **kwargs):
            return forward(*args, **change(kwargs))

        layer.self_attn.forward = dropping


def test_any_model_not_passing_kwargs_or_the_cache_to_attention_is_refused():
    """The check is general: a Llama whose decoder layers drop extra kwargs, or the cache, is refused too."""
    model = tiny_llama(seed=8)
    _wrap_attention(model, lambda kwargs: {k: v for k, v in kwargs.items() if k != "dual_cache"})
    _assert_refused_before_work(model, "do not pass generate\\(\\)'s keyword arguments")
    model = tiny_llama(seed=8)
    _wrap_attention(model, lambda kwargs: {**kwargs, "cache": None})
    _assert_refused_before_work(model, "does not hand the cache")


def test_unsupported_attention_implementation_and_dropout_are_refused_before_any_work():
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("my_attention", sdpa_attention_forward)
    AttentionMaskInterface.register("my_attention", sdpa_mask)
    model = tiny_llama(seed=9)
    model.set_attn_implementation("my_attention")
    _assert_refused_before_work(model, "set_attn_implementation\\('sdpa'\\)")
    model = tiny_llama(seed=9)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    model.train()
    _assert_refused_before_work(model, "dropout")


# --- attention implementations: the model's own one serves prefill and sliding layers ------------------------------
def test_eager_attention_left_padded_batch_matches_default_cache():
    model = tiny_llama(seed=10)
    model.set_attn_implementation("eager")
    ids = _prompt(11, 80, batch=2)
    mask = torch.ones_like(ids)
    mask[0, :25] = 0
    dense = model.generate(ids, attention_mask=mask, max_new_tokens=15, do_sample=False)
    dual, _ = _dual(model, ids, attention_mask=mask, max_new_tokens=15, cache_config={**FULL, "prefill_chunk_size": 32})
    assert torch.equal(dense, dual)
    assert model.config._attn_implementation == "eager"


# --- inputs_embeds ------------------------------------------------------------------------------------------------
def test_inputs_embeds_alone_and_with_input_ids_match_default_cache():
    model = tiny_llama(seed=12)
    ids = _prompt(13, 70, batch=2)
    embeds = model.get_input_embeddings()(ids).detach()
    for kwargs in ({"inputs_embeds": embeds}, {"inputs_embeds": 0.5 * embeds, "input_ids": ids}):
        dense = model.generate(**kwargs, max_new_tokens=12, do_sample=False)
        dual, _ = _dual(model, max_new_tokens=12, cache_config={**FULL, "prefill_chunk_size": 32}, **kwargs)
        assert torch.equal(dense, dual)
    # the embeddings are used (not the ids): scaled embeddings give another continuation than the ids alone
    assert not torch.equal(dual, model.generate(ids, max_new_tokens=12, do_sample=False))


# --- compiled models ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["module", "forward"])
def test_compiled_model_graph_breaks_around_the_cache(how):
    torch._dynamo.reset()
    model = tiny_llama(seed=14)
    ids = _prompt(15, 40)
    dense = model.generate(ids, max_new_tokens=8, do_sample=False)
    if how == "module":
        model.compile(backend="eager")  # dynamo tracing (where the cache broke), no inductor codegen
    else:
        model.forward = torch.compile(model.forward, backend="eager")
    dual, _ = _dual(model, ids, max_new_tokens=8, cache_config=FULL)
    assert torch.equal(dense, dual)
    assert torch.equal(dense, model.generate(ids, max_new_tokens=8, do_sample=False))  # default cache still fine
    torch._dynamo.reset()


# --- cache_config objects, deepcopy -------------------------------------------------------------------------------
def test_cache_config_accepts_a_dual_decoder_config_object():
    model = tiny_llama(seed=16)
    ids = _prompt(17, 60)
    options = {"budget": 8, "window": 4, "early_layers": 0}
    from_dict, _ = _dual(model, ids, max_new_tokens=10, cache_config=options)
    from_object, cache = _dual(model, ids, max_new_tokens=10, cache_config=DualDecoderConfig(**options))
    assert torch.equal(from_dict, from_object) and cache.dual_config.budget == 8


def test_deepcopy_of_a_fresh_cache_works_and_of_a_running_one_refuses_clearly():
    model = tiny_llama(seed=18)
    ids = _prompt(19, 60)
    options = {"budget": 8, "window": 4, "early_layers": 0, "retrieval_threads": 1}
    cache = DualDecoderCache(model.config, **options)
    fresh = copy.deepcopy(cache)
    assert fresh.dual_config == cache.dual_config and fresh.dual_config is not cache.dual_config
    assert all(layer.sequences is fresh.sequences for layer in fresh.dual_layers)  # shared with the copy, not the original
    errors = []

    class CopyMidway(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            try:
                copy.deepcopy(cache)
            except TypeError as error:
                errors.append(str(error))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    out = model.generate(ids, max_new_tokens=6, do_sample=False, cache=cache,
                         stopping_criteria=StoppingCriteriaList([CopyMidway()]))
    assert len(errors) == 6 and "cannot be copied" in errors[0]
    assert torch.equal(out, model.generate(ids, max_new_tokens=6, do_sample=False, cache=fresh))
    cache.close()  # a cache stays open after generate() (it may be continued)
    copy.deepcopy(cache)  # closed: copies (stats stay readable)


def test_a_forward_taking_only_kwargs_gets_the_cache_under_the_current_name_without_warnings():
    """A model whose `forward` takes `**kwargs` only (a wrapper) gets the cache, in `forward` and in its
    `prepare_inputs_for_generation`, under the name transformers' own generation uses (`cache` since 5.24), so no
    deprecation warning comes from the library; its tokens equal the default cache's (full budget)."""
    import warnings

    from transformers import LlamaForCausalLM

    base = tiny_llama()

    class Wrapped(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    model = Wrapped(base.config).eval()
    model.load_state_dict(base.state_dict())
    ids = _prompt(3, 24)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        dual = model.generate(ids, max_new_tokens=4, do_sample=False, cache_implementation="dual", cache_config=FULL)
    assert torch.equal(dual, base.generate(ids, max_new_tokens=4, do_sample=False))
