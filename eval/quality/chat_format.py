"""The model wrapper around a benchmark prompt: plain text, or one user turn of the tokenizer's chat template.

The official pipelines wrap a task's text in a fixed per-model string and tokenize the result with the tokenizer's
own special tokens: NVIDIA/RULER's `scripts/data/template.py` (`"base"` is the bare text; `"meta-llama3"` is one
user turn with no system turn), THUDM/LongBench's `pred.py` `build_chat` (e.g. `"[INST]{prompt}[/INST]"`; models
it does not list get the bare text). `PromptFormat` is that string for any tokenizer: derived from its chat
template for one user turn, *without* the default system prompt some templates insert (SmolLM2's "You are a
helpful AI assistant named SmolLM..."), unless a system prompt is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

CHAT_MODES = ("auto", "none")
#: `system_prompt` value that keeps whatever system turn the chat template adds by itself
TEMPLATE_DEFAULT = "template-default"
_TASK = "QZXTASKQZX"  # stands for the task text while the template renders (survives trimming templates)


@dataclass(frozen=True)
class PromptFormat:
    """`prefix + text + suffix` is the model input for a task text `text` (a str; tokenize it with the tokenizer's
    special tokens, as the official pipelines do). `chat` tells whether a chat template made it."""

    prefix: str = ""
    suffix: str = ""
    chat: bool = False

    def wrap(self, text: str) -> str:
        """The wrapped text."""
        return self.prefix + text + self.suffix


PLAIN = PromptFormat()


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _user_turn_start(tokenizer) -> str:
    """The text that opens a user turn after an assistant turn (e.g. `"<|im_start|>user\\n"`).

    Raises:
        ValueError: when the template renders a conversation in a way this cannot read.
    """
    first = [{"role": "user", "content": "QZXU1QZX"}, {"role": "assistant", "content": "QZXA1QZX"}]
    before = _render(tokenizer, first, False)
    after = _render(tokenizer, first + [{"role": "user", "content": _TASK}], True)
    if not after.startswith(before) or _TASK not in after[len(before):]:
        raise ValueError("this chat template does not render a second user turn after the first conversation.")
    return after[len(before):after.index(_TASK, len(before))]


def prompt_format(tokenizer, chat_template: str = "auto", system_prompt: str | None = None) -> PromptFormat:
    """The `PromptFormat` for `tokenizer`.

    Args:
        chat_template: `"auto"`: one user turn of the tokenizer's chat template when it has one (else plain text);
            `"none"`: plain text (RULER's `"base"` template; LongBench for models outside `build_chat`).
        system_prompt: None: no system turn, even where the template adds a default one (as RULER's and
            LongBench's wrappers have none); `TEMPLATE_DEFAULT`: whatever the template renders by itself; any other
            string: that system message.

    A textual BOS at the start of the wrapper is dropped when the tokenizer adds a BOS itself, so the tokenized
    prompt starts with exactly one.

    Raises:
        ValueError: unknown `chat_template`; a system prompt asked for without a chat template in use; a template
            whose default system turn cannot be separated from the user turn (pass `TEMPLATE_DEFAULT` or a text).
    """
    if chat_template not in CHAT_MODES:
        raise ValueError(f"chat_template must be one of {CHAT_MODES}, got {chat_template!r}.")
    if chat_template == "none" or not getattr(tokenizer, "chat_template", None):
        if system_prompt not in (None, TEMPLATE_DEFAULT):
            raise ValueError("a system prompt needs a chat template: this tokenizer has none (or chat_template is "
                             "'none').")
        return PLAIN
    messages = [{"role": "user", "content": _TASK}]
    if system_prompt not in (None, TEMPLATE_DEFAULT):
        messages.insert(0, {"role": "system", "content": system_prompt})
    prefix, suffix = _render(tokenizer, messages, True).split(_TASK)
    try:
        turn = _user_turn_start(tokenizer)
    except Exception:  # templates that refuse a second user turn: nothing to separate
        turn = ""
    bos = tokenizer.bos_token or ""
    # a BOS of its own (Llama 3, Gemma), not the opening of every turn (SmolLM2's BOS is "<|im_start|>")
    standalone_bos = bool(bos) and prefix.startswith(bos) and bool(turn) and not turn.startswith(bos)
    if system_prompt is None:
        cut = prefix.rfind(turn) if turn else -1
        if cut < 0:
            raise ValueError("cannot separate this chat template's user turn from its preamble; pass "
                             f"system_prompt={TEMPLATE_DEFAULT!r} or a system prompt text.")
        prefix = (bos if standalone_bos and cut > 0 else "") + prefix[cut:]
    if standalone_bos and prefix.startswith(bos) and adds_bos(tokenizer):
        prefix = prefix[len(bos):]
    return PromptFormat(prefix, suffix, chat=True)


def adds_bos(tokenizer) -> bool:
    """Whether `tokenizer(text)` (special tokens on) starts its ids with the BOS token."""
    bos = tokenizer.bos_token_id
    ids = tokenizer("a")["input_ids"]
    return bos is not None and len(ids) > 0 and ids[0] == bos


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text` with the tokenizer's special tokens (BOS where it adds one), as the official pipelines
    feed the model (`tokenizer(prompt)`)."""
    return list(tokenizer(text)["input_ids"])


def count_tokens(tokenizer, text: str) -> int:
    """Tokens of `text` without special tokens (RULER's length count, `tokenizer.tokenize`)."""
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])
