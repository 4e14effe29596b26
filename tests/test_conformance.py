"""generate() with the dual cache conforms to transformers' generate() with the default cache.

Organised like transformers' generation tests (`GenerationTesterMixin`): greedy decoding and sampling, each with and
without `return_dict_in_generate` and every `output_*` flag; left-padded batches; `inputs_embeds`; continuing from a
cache; `num_return_sequences`; logits processors and stopping criteria; streamers; explicit `position_ids`; outputs
used in autograd; model inputs (GPT-2's `token_type_ids`; image inputs of Gemma-3 and LLaVA vision-language models);
and what the dual cache refuses. Every case runs on tiny random-weight models built from configs (no Hub) and is
either equal to the default cache at full budget (fp32: the same tokens, and scores / logits / hidden states equal
up to float rounding) or refused with a `ValueError` before any work (`dual_cache/runtime/refusals.py`, whose table
docs/usage.md lists: checked here too).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import re
import threading
from pathlib import Path

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.streamers import BaseStreamer

from dual_cache import DualDecoderCache
from dual_cache.host.memory import live_host_bytes
from dual_cache.runtime.refusals import REFUSED
from tests.conftest import tiny_gemma3, tiny_llama, tiny_qwen2_mqa

ROOT = Path(__file__).resolve().parents[1]
# chunked prefill: 2-3 chunks here; the default cache's random draws (multinomial), so a seed gives its tokens
FULL = {"budget": 4096, "n_sink": 4, "window": 8, "prefill_chunk_size": 16, "coupled_sampling": False}
NEW = 6  # new tokens per generate()
OUTPUT_FLAGS = ("output_scores", "output_logits", "output_hidden_states")


def tiny_gpt2(seed: int = 0):
    """GPT-2: learned absolute positions, `token_type_ids` (embedded with the token embeddings), 4 MHA heads."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=512, eos_token_id=None,
                        bos_token_id=1, pad_token_id=0)
    return GPT2LMHeadModel(config).eval()


IMAGE_TOKEN = 4  # the vision-language models' image placeholder id (prompts use ids 5..95 elsewhere)


def tiny_gemma3_vlm(seed: int = 0):
    """Gemma-3 with a SigLIP vision tower: 32×32 images, 16 patches pooled into 4 image tokens, which attend to each
    other bidirectionally in the prefill (`token_type_ids`)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(seed)
    text = tiny_gemma3(seed).config.to_dict()
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=8)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=IMAGE_TOKEN, boi_token_index=2, eoi_token_index=3)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # initialised to zeros, which would make every image's tokens alike
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=0.5)
    return model


def tiny_llava(seed: int = 0):
    """LLaVA: a CLIP vision tower (32×32 images, 16 patch tokens) projected into a Llama."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=32, patch_size=8, projection_dim=32)
    config = LlavaConfig(text_config=tiny_llama(seed).config.to_dict(), vision_config=vision,
                         image_token_index=IMAGE_TOKEN, vision_feature_layer=-1, image_seq_length=16)
    return LlavaForConditionalGeneration(config).eval()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread avoids spin-waiting on a shared machine
    yield
    torch.set_num_threads(threads)


ARCHITECTURES = {"llama": tiny_llama, "qwen2-mqa": tiny_qwen2_mqa, "gemma3": tiny_gemma3, "gpt2": tiny_gpt2}
VISION_LANGUAGE = {"gemma3-vlm": (tiny_gemma3_vlm, 4), "llava": (tiny_llava, 16)}  # builder, image tokens


@functools.lru_cache(maxsize=None)
def model(name: str):
    """Each architecture's tiny model, built once (generate() leaves a model as it found it)."""
    return {**ARCHITECTURES, **{k: v[0] for k, v in VISION_LANGUAGE.items()}}[name](seed=3)


def prompt(seed: int, length: int = 28, batch: int = 2) -> torch.Tensor:
    return torch.randint(5, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


def both(m, seed: int | None = None, cache_config: dict | None = None, **kwargs):
    """`generate(**kwargs)` with the default cache and with the dual cache at full budget (the same seed first when
    sampling): `(default, dual)`."""
    outs = []
    for extra in ({}, {"cache_implementation": "dual", "cache_config": cache_config or FULL}):
        if seed is not None:
            torch.manual_seed(seed)
        outs.append(m.generate(**kwargs, **extra))
    return outs


def assert_same(default, dual) -> None:
    """Equal tokens; the same output fields with the same structure and shapes, and values equal up to float
    rounding (the dual decode attention sums in another order than the default cache's)."""
    if isinstance(default, torch.Tensor):
        assert isinstance(dual, torch.Tensor) and torch.equal(default, dual)
        return
    assert type(dual) is type(default)
    assert torch.equal(default.sequences, dual.sequences)
    for field in ("scores", "logits", "hidden_states", "attentions"):
        expected, got = getattr(default, field, None), getattr(dual, field, None)
        assert (expected is None) == (got is None), field
        if expected is None:
            continue
        assert len(expected) == len(got), field
        for a, b in zip(expected, got):
            pairs = zip(a, b) if isinstance(a, tuple) else [(a, b)]
            assert not isinstance(a, tuple) or len(a) == len(b), field
            for x, y in pairs:
                assert x.shape == y.shape, field
                torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5, msg=field)


def flags(which: str) -> dict:
    """generate() flags: `"tensor"` (none), `"dict"` (`return_dict_in_generate` alone), one `output_*` flag, or
    `"all"`."""
    if which == "tensor":
        return {}
    chosen = OUTPUT_FLAGS if which == "all" else [] if which == "dict" else [which]
    return {"return_dict_in_generate": True, **{f: True for f in chosen}}


# --- greedy decoding and sampling ----------------------------------------------------------------------------------
GREEDY_CASES = [(name, which) for name in ARCHITECTURES for which in ("tensor", "dict", "all")] + [
    ("llama", flag) for flag in OUTPUT_FLAGS]  # each flag alone on one architecture; all of them on every one


@pytest.mark.parametrize("name, which", GREEDY_CASES)
def test_greedy(name, which):
    m = model(name)
    assert_same(*both(m, input_ids=prompt(1), max_new_tokens=NEW, do_sample=False, **flags(which)))


@pytest.mark.parametrize("which", ["tensor", "all"])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_sampling_with_the_same_seed(name, which):
    m = model(name)
    kwargs = dict(input_ids=prompt(2), max_new_tokens=NEW, do_sample=True, temperature=0.9, top_k=40, top_p=0.95)
    assert_same(*both(m, seed=7, **kwargs, **flags(which)))


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_left_padded_batch(name):
    ids = prompt(3)
    mask = torch.ones_like(ids)
    mask[0, :9] = 0
    assert_same(*both(model(name), input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                      **flags("all")))


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_inputs_embeds(name):
    m = model(name)
    ids = prompt(4)
    embeds = m.get_input_embeddings()(ids).detach()
    assert_same(*both(m, inputs_embeds=embeds, max_new_tokens=NEW, do_sample=False, **flags("all")))


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_explicit_position_ids(name):
    """`position_ids` given (here: offset by 5, as a packed or shifted sequence would be) reach the model."""
    ids = prompt(5)
    positions = torch.arange(5, 5 + ids.shape[1]).expand_as(ids)
    default, dual = both(model(name), input_ids=ids, position_ids=positions, max_new_tokens=NEW, do_sample=False,
                         **flags("output_logits"))
    assert_same(default, dual)
    plain = model(name).generate(ids, max_new_tokens=NEW, do_sample=False, **flags("output_logits"))
    assert not torch.equal(plain.logits[0], dual.logits[0])  # the positions matter


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_continue_from_a_cache(name):
    """A second generate() on the cache the first returned prefills only the new tokens, as the default cache does."""
    m = model(name)
    ids, more = prompt(6), prompt(7, length=5)
    outs = []
    for extra in ({}, {"cache_implementation": "dual", "cache_config": FULL}):
        first = m.generate(ids, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, **extra)
        cache = first.cache if hasattr(first, "cache") else first.past_key_values
        outs.append(m.generate(torch.cat([first.sequences, more], 1), cache=cache, max_new_tokens=NEW,
                               do_sample=False, return_dict_in_generate=True, output_scores=True))
    assert isinstance(outs[1].cache, DualDecoderCache)
    assert_same(*outs)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_num_return_sequences(name):
    assert_same(*both(model(name), seed=8, input_ids=prompt(8), max_new_tokens=NEW, do_sample=True,
                      num_return_sequences=3, **flags("output_scores")))


class BanToken(LogitsProcessor):
    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids, scores):
        return scores.masked_fill(torch.arange(scores.shape[-1]) == self.token, float("-inf"))


class StopAtLength(StoppingCriteria):
    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_logits_processors_and_stopping_criteria(name):
    m = model(name)
    ids = prompt(9)
    free = m.generate(ids, max_new_tokens=NEW, do_sample=False)
    ban, eos = int(free[0, ids.shape[1]]), int(free[1, ids.shape[1] + 2])
    kwargs = dict(input_ids=ids, max_new_tokens=NEW + 4, do_sample=False, repetition_penalty=1.3,
                  no_repeat_ngram_size=2, min_new_tokens=2, logits_processor=LogitsProcessorList([BanToken(ban)]),
                  stopping_criteria=StoppingCriteriaList([StopAtLength(ids.shape[1] + NEW + 2)]), eos_token_id=eos,
                  pad_token_id=0)
    default, dual = both(m, **kwargs, **flags("output_scores"))
    assert_same(default, dual)
    assert ban not in dual.sequences[:, ids.shape[1]:].tolist()[0]


class Collect(BaseStreamer):
    def __init__(self) -> None:
        self.received = []

    def put(self, value):
        self.received.append(value.clone())

    def end(self):
        self.received.append("end")


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_streamer(name):
    streamers = [Collect(), Collect()]
    m = model(name)
    outs = [m.generate(prompt(10, batch=1), max_new_tokens=NEW, do_sample=False, streamer=s, **extra)
            for s, extra in zip(streamers, ({}, {"cache_implementation": "dual", "cache_config": FULL}))]
    assert_same(*outs)
    default, dual = (s.received for s in streamers)
    assert len(default) == len(dual) == NEW + 2 and default[-1] == dual[-1] == "end"
    assert all(torch.equal(a, b) for a, b in zip(default[:-1], dual[:-1]))


# --- outputs in autograd -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_outputs_are_ordinary_tensors_that_enter_autograd(name):
    """A training loop backpropagates through generated samples (reinforcement learning, distillation): the outputs
    are ordinary tensors, not inference tensors, and carry no autograd graph of their own."""
    m = model(name)
    out = m.generate(prompt(11), max_new_tokens=NEW, do_sample=True, cache_implementation="dual", cache_config=FULL,
                     **flags("all"))
    returned = [out.sequences, *out.scores, *out.logits, *(h for step in out.hidden_states for h in step)]
    assert not any(t.is_inference() or t.requires_grad or t.grad_fn is not None for t in returned)
    m.zero_grad()
    m(out.sequences, labels=out.sequences).loss.backward()
    assert all(p.grad is not None for p in m.get_input_embeddings().parameters())
    m.zero_grad(set_to_none=True)


def test_pipelined_path_outputs_are_ordinary_tensors():
    """At partial budget, with retrieval on worker threads and the copy stream simulated on a thread of its own (the
    CUDA ordering on CPU), the outputs are the synchronous reference path's, ordinary tensors, and no autograd graph
    is recorded on the launching thread (nothing saved for backward)."""
    from dual_cache.runtime.streams import simulated_streams

    m = model("llama")
    ids = prompt(17, length=64)
    partial = {"budget": 12, "n_sink": 4, "window": 8, "early_layers": 0, "prefill_chunk_size": 64}
    saved = []
    outs = []
    for threads in (0, 2):
        with simulated_streams() if threads else contextlib.nullcontext():
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                outs.append(m.generate(ids, max_new_tokens=NEW, do_sample=False, cache_implementation="dual",
                                       cache_config={**partial, "retrieval_threads": threads}, **flags("all")))
    assert not saved
    torch.testing.assert_close(outs[1].scores, outs[0].scores, rtol=0, atol=0)
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    returned = [outs[1].sequences, *outs[1].logits, *(h for step in outs[1].hidden_states for h in step)]
    assert not any(t.is_inference() or t.requires_grad for t in returned)
    m(outs[1].sequences, labels=outs[1].sequences).loss.backward()
    m.zero_grad(set_to_none=True)


# --- model inputs --------------------------------------------------------------------------------------------------
def test_gpt2_token_type_ids_reach_every_forward():
    """GPT-2's `token_type_ids` change its tokens; each prefill chunk gets its positions' types, each decode step its
    real token's type (the last one, extended per token as transformers extends it) for both the real and the
    speculated slot: the type transformers would give the speculated token's position."""
    m = model("gpt2")
    ids = prompt(12, length=30)
    types = torch.zeros_like(ids)
    types[0, 10:] = 1
    types[1, 20:25] = 1  # row 1 ends on type 0
    seen = []
    forward = m.forward

    @functools.wraps(forward)  # generate() checks its model kwargs against the forward's signature
    def spy(*args, **kwargs):
        seen.append(kwargs.get("token_type_ids"))
        return forward(*args, **kwargs)

    m.forward = spy
    try:
        for which in ("tensor", "all"):
            assert_same(*both(m, input_ids=ids, token_type_ids=types, max_new_tokens=NEW, do_sample=False,
                              **flags(which)))
        assert_same(*both(m, seed=13, input_ids=ids, token_type_ids=types, max_new_tokens=NEW, do_sample=True))
        seen.clear()
        m.generate(ids, token_type_ids=types, max_new_tokens=3, cache_implementation="dual", cache_config=FULL)
    finally:
        del m.forward
    prefill, steps = seen[:2], seen[2:]  # 30 tokens: chunks of 16 and 14 (the probe forward gets none)
    assert torch.equal(torch.cat(prefill, 1), types)
    assert len(steps) == 2 and all(torch.equal(s, types[:, -1:].expand(2, 2)) for s in steps)
    assert not torch.equal(m.generate(ids, max_new_tokens=NEW, do_sample=False),
                           m.generate(ids, token_type_ids=types, max_new_tokens=NEW, do_sample=False))


def image_prompt(name: str, seed: int):
    """`(input_ids, pixel_values, extra model kwargs)`: two rows, each with one image's placeholder tokens."""
    _, image_tokens = VISION_LANGUAGE[name]
    ids = prompt(seed, length=20 + image_tokens)
    ids[:, 3:3 + image_tokens] = IMAGE_TOKEN
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    extra = {"token_type_ids": (ids == IMAGE_TOKEN).long()} if name == "gemma3-vlm" else {}
    return ids, pixels, extra


@pytest.mark.parametrize("name", VISION_LANGUAGE)
def test_vision_language_model_with_an_image(name):
    """The image reaches the prefill (and only the prefill, as in transformers); the logits depend on it."""
    m = model(name)
    ids, pixels, extra = image_prompt(name, 14)
    options = {**FULL, "prefill_chunk_size": 64}  # raw image inputs go to one prefill forward
    for which in ("tensor", "all"):
        default, dual = both(m, cache_config=options, input_ids=ids, pixel_values=pixels, max_new_tokens=NEW,
                             do_sample=False, **extra, **flags(which))
        assert_same(default, dual)
    other = m.generate(ids, pixel_values=torch.randn_like(pixels), max_new_tokens=NEW, do_sample=False, **extra,
                       **flags("output_logits"))
    assert not torch.allclose(other.logits[0], dual.logits[0])  # the image matters
    assert_same(*both(m, seed=15, cache_config=options, input_ids=ids, pixel_values=pixels, max_new_tokens=NEW,
                      do_sample=True, **extra))


# --- refusals ------------------------------------------------------------------------------------------------------
class ReadsOutputs:
    """Stands in for a model whose `_update_model_kwargs_for_generation` reads the forward's outputs."""

    @staticmethod
    def update(outputs, model_kwargs, *args, **kwargs):
        model_kwargs["image_hidden_states"] = outputs.image_hidden_states
        return model_kwargs


REFUSAL_CASES = {  # name in REFUSED: generate() kwargs (None: an image prompt over two prefill chunks)
    "beam_search": {"num_beams": 2},
    "beam_sample": {"num_beams": 2, "do_sample": True},
    "assisted_generation": {"prompt_lookup_num_tokens": 2},
    "output_attentions": {"output_attentions": True, "return_dict_in_generate": True},
    "use_cache=False": {"use_cache": False},
    "synced_gpus": {"synced_gpus": True},
    "position_ids of another shape than (batch, input length)": {"position_ids": torch.arange(28).expand(3, 2, 28)},
    "model inputs updated from the model's outputs": {},
    "prefill-only model inputs over several prefill chunks": None,
}


@pytest.mark.parametrize("name, refused", [(name, refused) for refused, kwargs in REFUSAL_CASES.items()
                                           for name in (VISION_LANGUAGE if kwargs is None else ARCHITECTURES)])
def test_refused_before_any_work(name, refused, monkeypatch):
    """Refused with the `ValueError` of `REFUSED[refused]`, before any forward on the cache and with no thread or
    host memory left behind."""
    m, kwargs, ids = model(name), REFUSAL_CASES[refused], prompt(16)
    if kwargs is None:  # 20 text + the image's tokens, in chunks of 16
        ids, pixels, extra = image_prompt(name, 16)
        kwargs = {"pixel_values": pixels, **extra}
    if refused == "model inputs updated from the model's outputs":
        monkeypatch.setattr(m, "_update_model_kwargs_for_generation", ReadsOutputs.update)
    threads, host = threading.active_count(), live_host_bytes()
    for how in ("implementation", "object"):
        cache = DualDecoderCache(m.config, **FULL)
        extra = {"cache_implementation": "dual", "cache_config": FULL} if how == "implementation" else {"cache": cache}
        with pytest.raises(ValueError, match=re.escape(f"does not serve {refused}. {REFUSED[refused].why}")):
            m.generate(ids, max_new_tokens=3, **kwargs, **extra)
        assert cache.get_seq_length() == 0 and cache.requests == 0
    assert threading.active_count() == threads and live_host_bytes() == host


def test_layer_types_other_than_full_and_sliding_are_refused_when_the_cache_is_built():
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=2, layer_types=["full_attention", "linear_attention"])
    name = "layer types other than full and sliding-window attention"
    with pytest.raises(ValueError, match=re.escape(f"['linear_attention'] — the dual cache does not serve {name}")):
        DualDecoderCache(config, **FULL)


def _tiny_non_attention_models():
    """Tiny random models of every kind the dual cache refuses by its config: state-space and recurrent models without
    attention heads (Mamba, RWKV), and hybrids whose attention layers sit between state-space ones (Jamba, Bamba)."""
    from transformers import (BambaConfig, BambaForCausalLM, JambaConfig, JambaForCausalLM, MambaConfig,
                              MambaForCausalLM, RwkvConfig, RwkvForCausalLM)

    small = {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2}
    mamba = {"mamba_d_state": 4, "mamba_d_conv": 2, "mamba_expand": 2}
    heads = {"num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 32}
    return {
        "mamba": (MambaForCausalLM, MambaConfig(**small, state_size=4, expand=2, conv_kernel=2),
                  "models without attention heads"),
        "rwkv": (RwkvForCausalLM, RwkvConfig(**small, attention_hidden_size=16, intermediate_size=32, context_length=64),
                 "models without attention heads"),
        "jamba": (JambaForCausalLM, JambaConfig(**small, **heads, **mamba, attn_layer_period=2, attn_layer_offset=1,
                                                 expert_layer_period=2, expert_layer_offset=1, num_experts=2,
                                                 mamba_dt_rank=4),
                  "layer types other than full and sliding-window attention"),
        "bamba": (BambaForCausalLM, BambaConfig(**small, **heads, **mamba, mamba_n_heads=2, mamba_d_head=16,
                                                 attn_layer_indices=[1]),
                  "layer types other than full and sliding-window attention"),
    }


@pytest.mark.parametrize("kind", ["mamba", "rwkv", "jamba", "bamba"])
def test_models_without_attention_or_with_other_layers_are_refused_before_any_work(kind):
    """generate(cache_implementation="dual"), a cache built from the config and a cache of another model checked
    against this one all raise the refusal's ValueError (never an AttributeError from a missing attention field),
    with no thread or host memory left behind."""
    model_class, config, refused = _tiny_non_attention_models()[kind]
    torch.manual_seed(0)
    m = model_class(config).eval()
    threads, host = threading.active_count(), live_host_bytes()
    expected = re.escape(f"does not serve {refused}. {REFUSED[refused].why}")
    with pytest.raises(ValueError, match=expected):
        m.generate(prompt(8, batch=1) % 64, max_new_tokens=2, do_sample=False, cache_implementation="dual")
    with pytest.raises(ValueError, match=expected):
        DualDecoderCache(m.config, **FULL)
    with pytest.raises(ValueError, match=expected):
        DualDecoderCache(tiny_llama().config, **FULL).check_model(m)
    assert threading.active_count() == threads and live_host_bytes() == host


@pytest.mark.parametrize("config_name", ["ZambaConfig", "Zamba2Config", "xLSTMConfig", "FalconMambaConfig"])
def test_other_configs_without_served_attention_are_refused(config_name):
    """Configs whose tiny models do not build here (their defaults are enough to be refused)."""
    import transformers

    config = getattr(transformers, config_name)()
    with pytest.raises(ValueError, match="the dual cache does not serve (models without attention heads|layer types)"):
        DualDecoderCache(config, **FULL)


def test_every_mode_but_greedy_and_sampling_is_refused():
    served = {GenerationMode.GREEDY_SEARCH.value, GenerationMode.SAMPLE.value}
    assert {mode.value for mode in GenerationMode} - served <= set(REFUSED)


def _raised_names() -> set[str]:
    """The names every `refuse(...)` call in dual_cache/ raises with (a literal string, or a generation mode's)."""
    names = set()
    for path in (ROOT / "dual_cache").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "refuse" and node.args:
                argument = node.args[0]
                if isinstance(argument, ast.Constant):
                    names.add(argument.value)
                else:  # generate/integration.py: refuse(GenerationMode(mode).value)
                    assert "GenerationMode" in ast.unparse(argument), (path, ast.unparse(argument))
                    names |= {m.value for m in GenerationMode} - {"greedy_search", "sample"}
    return names


def test_docs_list_exactly_what_the_code_refuses():
    """docs/usage.md's table is `REFUSED`, entry for entry (name, why, instead), and every entry is raised by the
    code (no entry without a `refuse` call, no `refuse` call without an entry)."""
    text = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    section = text.split("### What the dual cache refuses", 1)[1].split("\n\n| refused |", 1)[1]
    rows = [line for line in ("| refused |" + section).split("\n\n")[0].splitlines()[2:]]
    documented = {}
    for row in rows:
        name, why, instead = (cell.strip() for cell in row.strip().strip("|").split(" | "))
        documented[name.strip("`")] = (why, instead)
    assert documented == {name: tuple(entry) for name, entry in REFUSED.items()}
    assert _raised_names() == set(REFUSED)
