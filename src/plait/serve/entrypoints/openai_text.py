"""A choice's text as its tokens come (incremental decoding, stop strings held back), and log-probabilities in the
shapes of OpenAI's completions and chat answers.

Special tokens (</s>, <|eot_id|>) are left out of the text unless the request says skip_special_tokens: false
(vLLM's default); the token ids are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

from plait.serve.engine.core import TokenEvent


def decoder(tokenizer, skip_special: bool) -> Callable[[list[int]], str]:
    """ids -> text with the request's treatment of special tokens (plait's character tokenizer has none)."""
    if skip_special and hasattr(tokenizer, "tokenizer"):  # a Hugging Face tokenizer.json (plait.data.hf_tokenizer)
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    return tokenizer.decode


class Text:
    """A choice's text as its tokens come: what is safe to send, and whether a stop string ended it.

    `min_tokens`: stop strings count only in text that came after that many tokens (vLLM's rule)."""

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str], min_tokens: int = 0):
        self.decode, self.stops, self.min_tokens = decode, stops, min_tokens
        self.tokens: list[int] = []
        self.text = ""
        self.sent = 0
        self.stopped = False
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.prefix = self.read = 0  # tokens[prefix:read] were decoded last time, as context for the next ones
        self.searchable = 0  # where stop strings may begin (the text's length when min_tokens was reached)

    def _decode_new(self) -> None:
        """Append the text the new tokens add: each step decodes only the tokens since the last text, with the
        ones before them as context (a decoder's spacing depends on its neighbours), not the whole sequence;
        a character still in pieces waits for its next token."""
        before = self.decode(self.tokens[self.prefix:self.read])
        after = self.decode(self.tokens[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.tokens)

    def add(self, token: int) -> str:
        """The new text to send after `token` ("" while it may still be the start of a stop string; "" after a stop
        string ended the text)."""
        if self.stopped:
            return ""
        before = len(self.text)
        self.tokens.append(token)
        self._decode_new()
        if len(self.tokens) <= self.min_tokens:
            self.searchable = len(self.text) if len(self.tokens) < self.min_tokens else before
        start = max(0, self.sent - self.hold, self.searchable)
        cut = min((i for i in (self.text.find(s, start) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True
            return self.flush()
        safe = len(self.text) - self.hold
        while safe > self.sent and self.text[safe - 1] == "\ufffd":  # a character still in pieces
            safe -= 1
        out = self.text[self.sent:max(safe, self.sent)]
        self.sent += len(out)
        return out

    def flush(self) -> str:
        if not self.stopped and self.read < len(self.tokens):  # the end: a character left in pieces is sent as it is
            before = self.decode(self.tokens[self.prefix:self.read])
            self.text += self.decode(self.tokens[self.prefix:])[len(before):]
            self.prefix = self.read = len(self.tokens)
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out


class Tokens:
    """How a token is shown in log-probabilities: its text, or "token_id:N" (return_tokens_as_token_ids)."""

    def __init__(self, tokenizer, ids_as_tokens: bool):
        self.tokenizer, self.ids_as_tokens = tokenizer, ids_as_tokens

    def __call__(self, token: int) -> str:
        return f"token_id:{token}" if self.ids_as_tokens else self.tokenizer.decode([token])


def completion_logprobs(show: Tokens, events: list[TokenEvent], offset: int = 0,
                        prompt: list[tuple[int, float | None, tuple]] | None = None) -> dict:
    """OpenAI's completion logprobs; `prompt` (echo): (token, logprob, top) of each prompt token first (the first
    one's logprob is None: nothing predicts it)."""
    rows = list(prompt or []) + [(e.token, e.logprob, e.top) for e in events]
    tokens = [show(t) for t, _, _ in rows]
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in rows],
            "top_logprobs": [({show(t): lp for t, lp in top} if lp is not None else None) for _, lp, top in rows],
            "text_offset": offsets}


def chat_logprobs(show: Tokens, events: list[TokenEvent]) -> dict:
    def entry(token: int, logprob: float | None) -> dict:
        text = show(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [entry(e.token, e.logprob) | {"top_logprobs": [entry(t, lp) for t, lp in e.top]} for e in events]}


def kept(text: Text, events: list[TokenEvent]) -> list[TokenEvent]:
    """The events whose tokens are in the text (a stop string cuts the last ones)."""
    if not text.stopped:
        return events
    out, length = [], 0
    for e in events:
        if length >= len(text.text):
            break
        out.append(e)
        length += len(text.decode([e.token]))
    return out
