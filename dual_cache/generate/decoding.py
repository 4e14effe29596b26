"""The dual-token decode loop (docs/design.md §2): each forward feeds `[x_t, x̂_{t+1}]`; slot 0 gives the real next
token through all of `generate()`'s logits processors and stopping criteria, slot 1's queries select the next
step's KV entries and its logits give the next speculated token. With `miss_repair`, the sequences whose speculated
token missed are marked before the next forward, whose layers re-select their entries with the real token's query;
the sequences that hit are re-selected only in the layers where the real query drifted (`repair_drift`). Tokens are
picked by `sampling.StepSampler`: under sampling the speculated slot's guess is drawn with the noise that will draw
the next real token (coupled sampling, `coupled_sampling`).

The request runs in named steps, as gpt-fast's generate loop does: `prefill` (the prompt's forwards and the first
token), `decode_step` (one dual-token forward and the next token), both picking tokens with `pick_tokens`, and
`dual_sample`'s loop between them (the streamer, the stop, the outputs). `TokenRules` holds what picks and stops
tokens for the call, `DecodeState` the sequences between steps.

`dual_sample` has the signature of `GenerationMixin._sample`; `integration.py` routes `generate()` here when the
cache is a `DualDecoderCache`. Every forward's model inputs are built as transformers builds them, from all of
`generate()`'s model keyword arguments (`model.inputs.ModelInputs`), and the loop runs under `torch.no_grad()` as
transformers' does, so its outputs are ordinary tensors that can enter an autograd graph. The step itself (speculation, repair decisions, the forward) is `step.DualStep`,
which the serving scheduler runs too; per step this loop reads the device once (the sampled tokens, which sequences
go on and the model's guess for the next speculated token, in one transfer). Each forward carries the cache as the
`dual_cache` keyword argument, which routes attention to the dual cache for that call only (`layer/routing.py`): the
shared model is never modified, so concurrent calls on one model, each with its own cache, are independent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.generation import LogitsProcessorList, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import logging

from ..cache.cache import DualDecoderCache
from ..cache.checks import check_model_serves_dual
from ..model.inputs import CACHE_KWARGS, ModelInputs, cache_kwarg_name, forward_inputs, input_positions
from ..runtime.progress import PrefillBar
from ..runtime.refusals import refuse
from ..runtime.streams import to_device, to_host_list
from .sampling import StepSampler
from .step import DualStep, StepOutput

logger = logging.get_logger(__name__)

CLOSE_AFTER = "dual_close_after"  # model_kwargs flag: the cache was made for this call alone (`integration.py`)


@dataclass
class TokenRules:
    """How a step's logits become tokens, fixed for the call: `generate()`'s processors, sampling and stopping
    criteria, and what `return_dict_in_generate` keeps of each picked token.

    Attributes:
        logits_processor: `generate()`'s `LogitsProcessorList`; stopping_criteria: its `StoppingCriteriaList`.
        sampler: the `StepSampler` (greedy or sampled, coupled or not).
        pad_token_id: `()` int64 device tensor fed to finished sequences (when an end-of-sequence criterion exists).
        has_eos: whether a stopping criterion stops on end-of-sequence tokens (finished sequences then get pads).
        device: the device of `input_ids`.
        scores, logits, hidden_states: per picked token, the processed `(B, V)` float32 scores, the raw `(B, V)`
            float32 logits and the real token's hidden states (per layer `(B, P, hidden)` for the first token,
            `(B, 1, hidden)` after), each a tuple when `return_dict_in_generate` asks for it, else None.
    """

    logits_processor: LogitsProcessorList
    stopping_criteria: StoppingCriteriaList
    sampler: StepSampler
    pad_token_id: torch.Tensor | None
    has_eos: bool
    device: torch.device
    scores: tuple | None = None
    logits: tuple | None = None
    hidden_states: tuple | None = None

    def keep(self, scores: torch.Tensor, logits: torch.Tensor, hidden: tuple[torch.Tensor, ...] | None) -> None:
        """Add one picked token's processed scores, raw logits and hidden states to what is asked to be kept."""
        if self.scores is not None:
            self.scores += (scores,)
        if self.logits is not None:
            self.logits += (logits,)
        if self.hidden_states is not None:
            self.hidden_states += (hidden,)


@dataclass
class DecodeState:
    """The request's sequences between steps: what each step reads and extends.

    Attributes:
        input_ids: `(B, T)` int64 on the device: the prompts and the tokens picked so far (what the processors and
            stopping criteria see).
        unfinished: `(B,)` int64 on the device, 1 for the sequences still generating (as transformers' `_sample`).
        attention_mask: `(B, T)` 0/1 on the device, or None when every position is real.
        host_ids: `(B, T)` int64 on the host, the same tokens (read once after the prefill, then extended by each
            step's one read); the speculators read them.
        next_position: per sequence, the position of the next real token.
        tokens: per sequence, the last picked real token (a pad for a finished sequence); live: per sequence, still
            generating (the host's copy of `unfinished`).
        guesses: per sequence, the model's guess for the token after the speculated one (from the last forward's
            speculated slot), or None when that forward had none (the prefill, `speculator="none"`).
        speculated: per sequence, the speculated token the last forward fed, or None (the prefill, one token per
            forward); last_hit: per sequence, whether it equalled the real token picked after it, or None before.
    """

    input_ids: torch.Tensor
    unfinished: torch.Tensor
    attention_mask: torch.Tensor | None
    host_ids: torch.Tensor
    next_position: list[int]
    tokens: list[int] = field(default_factory=list)
    live: list[bool] = field(default_factory=list)
    guesses: list[int] | None = None
    speculated: list[int] | None = None
    last_hit: list[bool] | None = None


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

    The request in three named steps: `prefill` (the prompt's forwards and the first token), `decode_step` (one
    dual-token forward and the next token) and this loop between them (the streamer, the stop, the outputs).

    Args:
        input_ids: `(B, P)` int64 left-padded prompts (`(B, 0)` or ignored for the prefill when `inputs_embeds`
            are given, as transformers does).
        model_kwargs: must hold the `DualDecoderCache` (under `cache` or `past_key_values`) and may hold the
            `(B, P)` `attention_mask`, `(B, P)` `position_ids`, `(B, P, hidden)` `inputs_embeds` (then the prompt:
            prefill from them) and any other model input, passed on as transformers passes it
            (`model.inputs.ModelInputs`).
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

    return_dict = generation_config.return_dict_in_generate
    rules = TokenRules(logits_processor, stopping_criteria, StepSampler(generation_config.do_sample,
                                                                        config.coupled_sampling),
                       generation_config._pad_token_tensor, any(hasattr(c, "eos_token_id") for c in stopping_criteria),
                       input_ids.device,
                       scores=() if (return_dict and generation_config.output_scores) else None,
                       logits=() if (return_dict and generation_config.output_logits) else None,
                       hidden_states=() if (return_dict and generation_config.output_hidden_states) else None)

    embeds = model_kwargs.get("inputs_embeds")
    prompt = input_ids if embeds is None else embeds
    batch, input_len = prompt.shape[:2]
    attention_mask = model_kwargs.get("attention_mask")
    stored = cache.get_seq_length()
    if synced_gpus:
        raise refuse("synced_gpus")
    if stored:  # continue the cached sequences: only the new tokens are prefilled
        cache.check_continuation(input_ids if embeds is None else None, input_len, attention_mask)
    positions = input_positions(model_kwargs, attention_mask, batch, input_len, input_ids.device)
    inputs = ModelInputs(model, model_kwargs, cache_arg, input_len - stored, config.prefill_chunk_size)

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
        cache.begin_request(batch, total_tokens, model.dtype, input_ids.device, attention_mask, input_len)
        with torch.no_grad():
            state = prefill(model, cache, cache_arg, inputs, rules, input_ids, prompt, positions, attention_mask,
                            stored)
            while True:
                if streamer is not None:
                    streamer.put(torch.tensor(state.tokens))
                if not any(state.live):
                    break
                decode_step(step, cache, inputs, rules, state)
        cache.end_request(state.input_ids if embeds is None else None)
    except BaseException:
        cache.close()  # a request that did not finish leaves nothing to continue
        raise
    if close_after:
        cache.close()

    if streamer is not None:
        streamer.end()
    if return_dict:
        cache_field = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"
        return GenerateDecoderOnlyOutput(sequences=state.input_ids, scores=rules.scores, logits=rules.logits,
                                         hidden_states=rules.hidden_states, **{cache_field: cache})
    return state.input_ids


def prefill(model, cache: DualDecoderCache, cache_arg: str, inputs: ModelInputs, rules: TokenRules,
            input_ids: torch.Tensor, prompt: torch.Tensor, positions: torch.Tensor,
            attention_mask: torch.Tensor | None, stored: int) -> DecodeState:
    """The prompt's forward passes (`prefill_chunk_size` positions each, from the `stored` ones on) and the first
    token; between `cache.begin_request` and the first `decode_step`.

    Args:
        input_ids: `(B, P)` int64 prompts on the device; prompt: the same, or the `(B, P, hidden)` `inputs_embeds`
            the prefill feeds instead. positions: `(B, P)` int64 position ids. attention_mask: `(B, P)` 0/1 or None.
        stored: prompt positions the cache already holds (a continued request); only the others are fed.

    Returns:
        The sequences' `DecodeState` with the first token picked (`pick_tokens` on the last prompt position's
        logits; the prompt's hidden states, per layer `(B, P - stored, hidden)`, kept when asked).
    """
    config = cache.dual_config
    input_len = prompt.shape[1]
    keep_hidden = rules.hidden_states is not None
    chunk = config.prefill_chunk_size
    prefill_hidden = []
    # a bar over every chunk's layers (`progress.PrefillBar`; none unless asked: even a disabled tqdm bar starts
    # tqdm's monitor thread)
    bar = PrefillBar(model, input_len - stored, chunk, enabled=config.prefill_progress)
    try:
        for start in range(stored, input_len, chunk):
            end = min(start + chunk, input_len)
            chunk_inputs = inputs.prefill(prompt[:, start:end], end,
                                          None if attention_mask is None else attention_mask[:, :end],
                                          positions[:, start:end], cache)
            outputs = model(**chunk_inputs, **forward_inputs(cache, cache_arg, 1, cache.prefill_call()))
            if keep_hidden:
                prefill_hidden.append(outputs.hidden_states)
            cache.crop(0)  # sliding-window layers drop what falls out of their window
    finally:
        bar.close()
    cache.end_prefill()
    logits = outputs.logits[:, -1].to(dtype=torch.float32, device=rules.device)
    del outputs
    hidden = None
    if keep_hidden:  # the prompt's, one tensor per layer, as one forward would give them
        hidden = tuple(torch.cat(layer, dim=1) for layer in zip(*prefill_hidden))
        del prefill_hidden
    batch = input_ids.shape[0]
    state = DecodeState(input_ids, torch.ones(batch, dtype=torch.long, device=rules.device), attention_mask,
                        torch.tensor(to_host_list(input_ids), dtype=torch.long).reshape(batch, -1),
                        to_host_list(positions[:, -1] + 1))
    pick_tokens(cache, inputs, rules, state, StepOutput(logits, None, hidden))
    return state


def decode_step(step: DualStep, cache: DualDecoderCache, inputs: ModelInputs, rules: TokenRules,
                state: DecodeState) -> None:
    """One dual-token step: one forward of every sequence's last real token (`state.tokens`; pads for finished
    sequences) plus the speculated token `step.propose` guesses after it (none with `speculator="none"`), then the
    next real token (`pick_tokens` on the forward's `(B, V)` float32 logits of both slots).

    The rows whose entries a mis-speculated token chose (every row on the first step) are re-selected in the layers
    (`step.DualStep.forward`). Extends `state.attention_mask` by the real token's position (`(B, T + 1)`; the
    forward's mask `(B, T + q)` adds the speculated slot). Updates `state` in place: its `tokens` (per sequence, the
    token just picked) and `live` are what the loop streams and stops on.
    """
    state.speculated = step.propose(list(state.host_ids), state.guesses, state.last_hit)
    step_mask = None
    if state.attention_mask is not None:
        mask = state.attention_mask
        state.attention_mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
        step_mask = torch.cat([state.attention_mask, mask.new_ones(mask.shape[0], step.tokens_per_forward - 1)],
                              dim=-1)
    output = step.forward(cache, state.tokens, state.speculated, state.next_position, step_mask, state.live,
                          state.last_hit, inputs)
    state.next_position = [p + 1 for p in state.next_position]
    pick_tokens(cache, inputs, rules, state, output)


def pick_tokens(cache: DualDecoderCache, inputs: ModelInputs, rules: TokenRules, state: DecodeState,
                output: StepOutput) -> None:
    """Pick each sequence's next real token from a forward's `(B, V)` float32 logits, and the model's guess for the
    token after the speculated one; apply the stopping criteria; read all three from the device in one transfer.

    The guess is the argmax of the speculated slot's logits, or under coupled sampling a draw with the noise of the
    next real token from its processed scores on the sequence extended by the speculated token (the processors run
    twice a step only then: a stateful one is safe under greedy decoding and with `coupled_sampling=False`).
    Updates `state` (`input_ids`, `unfinished`, `host_ids`, `tokens`, `live`, `guesses`, `last_hit`) and what
    `rules` keeps; records the speculation's hits on the cache.
    """
    next_scores = rules.logits_processor(state.input_ids, output.logits)
    rules.keep(next_scores, output.logits, output.hidden_states)
    next_tokens = rules.sampler.real(next_scores)
    if rules.has_eos:
        next_tokens = next_tokens * state.unfinished + rules.pad_token_id * (1 - state.unfinished)
    if output.spec_logits is None:
        chained = next_tokens
    elif rules.sampler.coupled:
        extended = torch.cat([state.input_ids, to_device(state.speculated, rules.device)[:, None]], dim=-1)
        chained = rules.sampler.speculated(rules.logits_processor(extended, output.spec_logits))
    else:
        chained = rules.sampler.speculated(output.spec_logits)
    state.input_ids = torch.cat([state.input_ids, next_tokens[:, None]], dim=-1)
    inputs.advance()
    state.unfinished = state.unfinished & ~rules.stopping_criteria(state.input_ids, rules.scores)
    # the step's one read from the device: the sampled tokens, which sequences go on, the model's guess
    tokens, still, guesses = to_host_list(torch.stack([next_tokens, state.unfinished.long(), chained]))
    if state.speculated is not None:
        state.last_hit = [t == s for t, s in zip(tokens, state.speculated)]
        cache.record_speculation([h if on else None for h, on in zip(state.last_hit, state.live)])
    state.host_ids = torch.cat([state.host_ids, torch.tensor(tokens)[:, None]], dim=1)
    state.tokens, state.live = tokens, [bool(on) for on in still]
    state.guesses = None if output.spec_logits is None else guesses
