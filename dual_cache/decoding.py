"""The dual-token decode loop (docs/design.md §2): each forward feeds `[x_t, x̂_{t+1}]`; slot 0 gives the real next
token through all of `generate()`'s logits processors and stopping criteria, slot 1's queries select the next
step's KV entries and its logits give the next speculated token. With `miss_repair`, the sequences whose speculated
token missed are marked before the next forward, whose layers re-select their entries with the real token's query;
the sequences that hit are re-selected only in the layers where the real query drifted (`repair_drift`). Tokens are
picked by `sampling.StepSampler`: under sampling the speculated slot's guess is drawn with the noise that will draw
the next real token (coupled sampling, `coupled_sampling`).

`dual_sample` has the signature of `GenerationMixin._sample`; `integration.py` routes `generate()` here when the
cache is a `DualDecoderCache`. Every forward's model inputs are built as transformers builds them, from all of
`generate()`'s model keyword arguments (`model_inputs.ModelInputs`), and the loop runs under `torch.no_grad()` as
transformers' does, so its outputs are ordinary tensors that can enter an autograd graph. The step itself (speculation, repair decisions, the forward) is `step.DualStep`,
which the serving scheduler runs too; per step this loop reads the device once (the sampled tokens, which sequences
go on and the model's guess for the next speculated token, in one transfer). Each forward carries the cache as the
`dual_cache` keyword argument, which routes attention to the dual cache for that call only (`routing.py`): the
shared model is never modified, so concurrent calls on one model, each with its own cache, are independent.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import logging

from .cache import DualDecoderCache
from .checks import check_model_serves_dual
from .model_inputs import CACHE_KWARGS, ModelInputs, forward_inputs, input_positions
from .refusals import refuse
from .sampling import StepSampler
from .step import DualStep, cache_kwarg_name
from .streams import to_device, to_host_list

logger = logging.get_logger(__name__)

CLOSE_AFTER = "dual_close_after"  # model_kwargs flag: the cache was made for this call alone (`integration.py`)


def dual_sample(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    **model_kwargs,
):
    """Generate with dual-token decoding; arguments and return value as `GenerationMixin._sample`.

    Args:
        input_ids: `(B, P)` int64 left-padded prompts (`(B, 0)` or ignored for the prefill when `inputs_embeds`
            are given, as transformers does).
        model_kwargs: must hold the `DualDecoderCache` (under `cache` or `past_key_values`) and may hold the
            `(B, P)` `attention_mask`, `(B, P)` `position_ids`, `(B, P, hidden)` `inputs_embeds` (then the prompt:
            prefill from them) and any other model input, passed on as transformers passes it
            (`model_inputs.ModelInputs`).
        streamer: transformers' streamer contract (`put` per token, `end`).

    Raises:
        ValueError: before any work, for a model or model input the dual cache cannot serve
            (`checks.check_model_serves_dual`, `refusals.REFUSED`).

    Returns:
        `(B, P + new)` sequences, or `GenerateDecoderOnlyOutput` with `scores` / `logits` / `hidden_states` (the
        real tokens': per new token, per layer `(B, P, hidden)` for the prefill's, `(B, 1, hidden)` after) and the
        cache when `return_dict_in_generate=True`. Ordinary tensors (computed under `torch.no_grad()`).
    """
    cache: DualDecoderCache = next(model_kwargs[k] for k in CACHE_KWARGS if k in model_kwargs)
    close_after = model_kwargs.pop(CLOSE_AFTER, False)
    config = cache.dual_config
    cache_arg = cache_kwarg_name(model)
    step = DualStep(model, config)

    pad_token_id = generation_config._pad_token_tensor
    has_eos_stopping_criteria = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    return_dict = generation_config.return_dict_in_generate
    scores = () if (return_dict and generation_config.output_scores) else None
    raw_logits = () if (return_dict and generation_config.output_logits) else None
    hidden_states = () if (return_dict and generation_config.output_hidden_states) else None
    sampler = StepSampler(generation_config.do_sample, config.coupled_sampling)

    embeds = model_kwargs.get("inputs_embeds")
    prompt = input_ids if embeds is None else embeds
    batch, input_len = prompt.shape[:2]
    device = input_ids.device
    attention_mask = model_kwargs.get("attention_mask")
    stored = cache.get_seq_length()
    if synced_gpus:
        raise refuse("synced_gpus")
    if stored:  # continue the cached sequences: only the new tokens are prefilled
        cache.check_continuation(input_ids if embeds is None else None, input_len, attention_mask)
    positions = input_positions(model_kwargs, attention_mask, batch, input_len, device)
    inputs = ModelInputs(model, model_kwargs, cache_arg, input_len - stored, config.prefill_chunk_size)
    unfinished = torch.ones(batch, dtype=torch.long, device=device)

    cache.check_model(model)  # the model itself: under tensor parallelism the cache holds this rank's KV heads
    total_tokens = input_len + max(generation_config.max_length - input_ids.shape[1], 0) + 1
    try:
        if not stored:
            cache.fit_layers(max(cache.max_cache_len or 0, total_tokens))
            probe_input = {"input_ids" if embeds is None else "inputs_embeds": prompt[:1, -1:]}
            check_model_serves_dual(model, cache, cache_arg, probe_input)
            if not cache.dual_layers:
                logger.warning_once(
                    f"Every layer of {type(model).__name__} attends over a sliding window shorter than this request "
                    f"({total_tokens} tokens per sequence): the dual cache keeps each window on the device, as the "
                    "default cache does, and has nothing to offload."
                )
        cache.begin_request(batch, total_tokens, model.dtype, device, attention_mask, input_len)
        with torch.no_grad():
            chunk = config.prefill_chunk_size
            starts = range(stored, input_len, chunk)
            if config.prefill_progress:  # a tqdm bar, even disabled, starts tqdm's monitor thread
                starts = tqdm(starts, desc="prefill", unit="chunk")
            prefill_hidden = []
            for start in starts:
                end = min(start + chunk, input_len)
                chunk_inputs = inputs.prefill(prompt[:, start:end], end,
                                              None if attention_mask is None else attention_mask[:, :end],
                                              positions[:, start:end], cache)
                outputs = model(**chunk_inputs, **forward_inputs(cache, cache_arg, 1, cache.prefill_call()))
                if hidden_states is not None:
                    prefill_hidden.append(outputs.hidden_states)
                cache.crop(0)  # sliding-window layers drop what falls out of their window
            cache.end_prefill()
            step_logits = outputs.logits[:, -1].to(dtype=torch.float32, device=device)
            del outputs
            if hidden_states is not None:  # the prompt's, one tensor per layer, as one forward would give them
                step_hidden = tuple(torch.cat(layer, dim=1) for layer in zip(*prefill_hidden))
                del prefill_hidden
            # what the host keeps of the sequences (read once here, then extended by each step's one read)
            host_ids = torch.tensor(to_host_list(input_ids), dtype=torch.long).reshape(batch, -1)
            next_position = to_host_list(positions[:, -1] + 1)
            live = [True] * batch
            spec_logits = speculated = last_hit = None

            while True:
                next_scores = logits_processor(input_ids, step_logits)
                if return_dict:
                    if scores is not None:
                        scores += (next_scores,)
                    if raw_logits is not None:
                        raw_logits += (step_logits,)
                    if hidden_states is not None:
                        hidden_states += (step_hidden,)
                next_tokens = sampler.real(next_scores)
                if has_eos_stopping_criteria:
                    next_tokens = next_tokens * unfinished + pad_token_id * (1 - unfinished)
                # the model's guess for the token after the speculated one: the argmax of the speculated slot's logits,
                # or under coupled sampling a draw with the noise of the next real token from its processed scores on
                # the sequence extended by it (the processors run twice a step only then: a stateful one is safe
                # under greedy decoding and with coupled_sampling=False)
                if spec_logits is None:
                    chained = next_tokens
                elif sampler.coupled:
                    chained = sampler.speculated(logits_processor(
                        torch.cat([input_ids, to_device(speculated, device)[:, None]], dim=-1), spec_logits))
                else:
                    chained = sampler.speculated(spec_logits)
                input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
                inputs.advance()
                unfinished = unfinished & ~stopping_criteria(input_ids, scores)
                # the step's one read from the device: the sampled tokens, which sequences go on, the model's guess
                tokens, still, guesses = to_host_list(torch.stack([next_tokens, unfinished.long(), chained]))
                if speculated is not None:
                    last_hit = [t == s for t, s in zip(tokens, speculated)]
                    cache.record_speculation(sum(h and on for h, on in zip(last_hit, live)), sum(live))
                host_ids = torch.cat([host_ids, torch.tensor(tokens)[:, None]], dim=1)
                if streamer is not None:
                    streamer.put(torch.tensor(tokens))
                live = [bool(on) for on in still]
                if not any(live):
                    break

                # one forward: the real token, plus the speculated one unless the speculator is "none"; the rows whose
                # entries a mis-speculated token chose (every row on the first step) are re-selected in the layers
                speculated = step.propose(list(host_ids), None if spec_logits is None else guesses, last_hit)
                if attention_mask is not None:
                    attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, 1)], dim=-1)
                    step_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, step.tokens_per_forward - 1)],
                                          dim=-1)
                else:
                    step_mask = None
                step_logits, spec_logits, step_hidden = step.forward(cache, tokens, speculated, next_position,
                                                                     step_mask, live, last_hit, inputs)
                next_position = [p + 1 for p in next_position]
        cache.end_request(input_ids if embeds is None else None)
    except BaseException:
        cache.close()  # a request that did not finish leaves nothing to continue
        raise
    if close_after:
        cache.close()

    if streamer is not None:
        streamer.end()
    if return_dict:
        cache_field = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"
        return GenerateDecoderOnlyOutput(sequences=input_ids, scores=scores, logits=raw_logits,
                                         hidden_states=hidden_states, **{cache_field: cache})
    return input_ids
