"""What the dual cache refuses, and why: one table (`REFUSED`) that every refusal is raised from (`refuse`), and
that docs/usage.md ("What the dual cache refuses") lists entry for entry (tests/test_conformance.py checks both).

A refusal is a `ValueError` raised before any work starts: no forward has run on the dual cache, no thread, host
memory or device memory is held. Everything `generate()` accepts that is not listed here works as with the default
cache (tests/test_conformance.py).
"""

from __future__ import annotations

from typing import NamedTuple


class Refusal(NamedTuple):
    """One thing the dual cache does not serve.

    Attributes:
        why: why it cannot be served (one or two sentences).
        instead: what to change.
    """

    why: str
    instead: str


_BEAMS = Refusal(
    "Beam methods reorder and prune the sequences of the batch every step; the dual cache's host stores, indexes and "
    "selections are per sequence and are never reordered.",
    "Set num_beams=1 (greedy decoding or sampling), or use the default cache.",
)

REFUSED: dict[str, Refusal] = {
    # generation modes (transformers' `GenerationMode` values): every one but greedy_search and sample
    "beam_search": _BEAMS,
    "beam_sample": _BEAMS,
    "group_beam_search": _BEAMS,
    "constrained_beam_search": _BEAMS,
    "assisted_generation": Refusal(
        "Assisted decoding (assistant_model, prompt_lookup_num_tokens, assistant_early_exit) verifies several "
        "candidate tokens per forward and crops the rejected ones; the dual step feeds one real and one speculated "
        "token.",
        "Drop those arguments (the dual cache speculates on its own: cache_config's speculator), or use the default "
        "cache.",
    ),
    "contrastive_search": Refusal(
        "Contrastive search (penalty_alpha) runs top_k candidate tokens per sequence through the model each step "
        "and keeps one, which needs a cache that expands and selects sequences.",
        "Drop penalty_alpha, or use the default cache.",
    ),
    "dola_generation": Refusal(
        "DoLa decoding (dola_layers) contrasts early layers' logits in a decoding loop of its own, not the dual one.",
        "Drop dola_layers, or use the default cache.",
    ),
    # generation flags
    "output_attentions": Refusal(
        "Decode attention reads the sink, the selected entries and the window, not every position, so there are no "
        "attention weights over the whole sequence to return.",
        "Unset output_attentions, or use the default cache.",
    ),
    "use_cache=False": Refusal(
        "The dual cache is the decode steps' KV cache; without a cache there is nothing to serve.",
        "Leave use_cache at True.",
    ),
    "synced_gpus": Refusal(
        "The dual loop stops when its own sequences are done; it does not run the extra forwards that FSDP or "
        "DeepSpeed ZeRO-3 peers wait for.",
        "Use the default cache with synced_gpus (tensor parallelism with tp_plan does not need it).",
    ),
    # model inputs
    "position_ids of another shape than (batch, input length)": Refusal(
        "The dual step feeds one position per token, counted on from the input's positions (3-D positions such "
        "as multimodal RoPE's, or positions of part of the input, are not served).",
        "Pass 2-D position_ids covering the whole input, or none (they follow from attention_mask), or use the "
        "default cache.",
    ),
    "prefill-only model inputs over several prefill chunks": Refusal(
        "pixel_values, input_features and the other inputs transformers gives the first forward only cannot be split "
        "between prefill chunks (transformers' own chunked prefill refuses them too).",
        "Raise cache_config's prefill_chunk_size to at least the prompt length.",
    ),
    "model inputs updated from the model's outputs": Refusal(
        "The dual loop extends the model's inputs by one position per token with the model's own "
        "_update_model_kwargs_for_generation, without the forward's outputs (a dual step's outputs cover the "
        "speculated token too).",
        "Use the default cache for this model.",
    ),
    # models
    "attention implementations other than sdpa and eager": Refusal(
        "The dual prefill reads the model's own attention masks, which only these two implementations give as "
        "tensors.",
        "Call model.set_attn_implementation('sdpa') (or load it with attn_implementation='sdpa') before generate().",
    ),
    "decoder layers that do not hand the cache to attention": Refusal(
        "The dual cache stores a layer's keys and values when the layer's attention updates the cache.",
        "Use the default cache for this model.",
    ),
    "decoder layers that do not pass generate()'s keyword arguments to attention": Refusal(
        "The dual cache serves a layer's attention through the dual_cache keyword argument of the call, which such "
        "layers drop (e.g. StableLM's); they would silently attend densely.",
        "Use the default cache for this model.",
    ),
    "attention dropout or attention sinks": Refusal(
        "The dual decode attention implements neither (attention dropout applies in training mode only).",
        "Call model.eval() before generate(), or use the default cache for a model with attention sinks.",
    ),
    "models without attention heads": Refusal(
        "The dual cache holds the keys and values of attention layers, per KV head; a model whose config declares no "
        "attention heads (num_attention_heads: state-space and recurrent models such as Mamba, RWKV, xLSTM) keeps "
        "other state.",
        "Use the default cache for this model.",
    ),
    "layer types other than full and sliding-window attention": Refusal(
        "The dual cache serves full-attention layers from the host and keeps sliding windows on the device; other "
        "layers (linear attention, state-space layers, ...) keep other state.",
        "Use the default cache for this model.",
    ),
}


def refuse(name: str, found: str = "") -> ValueError:
    """The `ValueError` refusing `REFUSED[name]`, to raise before any work.

    Args:
        name: a key of `REFUSED`.
        found: what was found, leading the message (e.g. which layers, which inputs); default: `name` alone.

    Raises:
        KeyError: for a name that is not in `REFUSED`.
    """
    entry = REFUSED[name]
    lead = f"{found} — the dual cache does not serve {name}" if found else f"The dual cache does not serve {name}"
    return ValueError(f"{lead}. {entry.why} {entry.instead}")
