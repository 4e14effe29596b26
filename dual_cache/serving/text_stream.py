"""Text of a request's tokens as the server sends it: cut before a stop string, and, when streaming, only what can
no longer change (no half UTF-8 character, nothing that could still become a stop string)."""

from __future__ import annotations


class TextStream:
    """Incremental detokenization of one request: the text that is safe to send after each token (no half
    UTF-8 character, nothing that could still become a stop string), and the final text cut before a stop."""

    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = 0

    def text(self, token_ids: list[int]) -> str:
        """The text of `token_ids` (special tokens skipped), cut before the first stop string it contains."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        return text if cut < 0 else text[:cut]

    def delta(self, token_ids: list[int], final: bool) -> str:
        """The text not sent yet: all of it when `final`, else what no later token can change."""
        text = self.text(token_ids)
        end = len(text) if final else max(self.sent, len(text) - self.hold)
        if not final and text[self.sent:end].endswith("\ufffd"):
            end = self.sent
        piece, self.sent = text[self.sent:end], max(self.sent, end)
        return piece
