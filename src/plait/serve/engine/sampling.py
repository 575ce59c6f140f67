"""What a request asks of the sampler, validated once in one type, and the logits processors that carry it out.

`SamplingParams` holds every sampling option of a request (the OpenAI and vLLM fields, translated by the
entrypoints); `validate()` names the first wrong field (`InvalidParam.param`). `Processors` are one sequence's
logits processors, applied to its last logits before the token is drawn, in vLLM's order: logit bias, the
min-tokens mask, the repetition penalty (prompt and output), the frequency and presence penalties (output only),
then a grammar's mask (structured output). Log-probabilities are reported from the model's own logits, before
any processor (as vLLM and transformers' `compute_transition_scores` of the raw scores do).
"""

from __future__ import annotations

import functools
import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on one token's bias


class InvalidParam(ValueError):
    """A sampling parameter out of its range: `param` names the field, the message what it takes."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class TokenMask(Protocol):
    """A grammar over tokens (structured output): which tokens may come next, and the token that came."""

    def allowed(self, vocab: int) -> torch.Tensor | None:
        """A (vocab,) bool tensor of the tokens allowed next, or None when any token is."""

    def accept(self, token: int) -> None:
        """Advance past the token drawn."""

    def finished(self) -> bool:
        """True when the grammar is complete and only a stop token may follow."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_k: int | None = None
    top_p: float = 1.0
    seed: int = 0
    stop_ids: frozenset[int] = frozenset()  # tokens that end the sequence (and are part of its output)
    logprobs: int | None = None  # None: no log-probabilities; k: the chosen token's and the k most likely
    presence_penalty: float = 0.0  # subtracted from the logit of every token the output holds (OpenAI, -2 to 2)
    frequency_penalty: float = 0.0  # subtracted once per time the output holds the token (OpenAI, -2 to 2)
    repetition_penalty: float = 1.0  # a seen token's logit divided by it when positive, times it when not (CTRL)
    min_tokens: int = 0  # the stop tokens are masked until this many tokens came
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias added to its logit)
    prompt_logprobs: int | None = None  # None, or k: each prompt token's log-probability and the k most likely
    grammar: object = None  # a factory of TokenMask (structured output), called once per sequence

    def validate(self, vocab: int | None = None) -> SamplingParams:
        """This, or InvalidParam naming the first field out of its range."""
        finite = {"temperature": self.temperature, "top_p": self.top_p, "presence_penalty": self.presence_penalty,
                  "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty}
        for name, value in finite.items():
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InvalidParam(name, f"'{name}' must be a finite number, got {value!r}")
        checks = (("max_tokens", self.max_tokens >= 1, "at least 1"),
                  ("temperature", 0 <= self.temperature <= 2, "between 0 and 2"),
                  ("top_p", 0 < self.top_p <= 1, "greater than 0 and at most 1"),
                  ("top_k", self.top_k is None or self.top_k >= 1, "at least 1 (or -1 / 0: all tokens)"),
                  ("presence_penalty", -2 <= self.presence_penalty <= 2, "between -2 and 2"),
                  ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "between -2 and 2"),
                  ("repetition_penalty", 0 < self.repetition_penalty <= 2, "greater than 0 and at most 2"),
                  ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, f"between 0 and max_tokens "
                                                                          f"({self.max_tokens})"))
        for name, ok, rule in checks:
            if not ok:
                raise InvalidParam(name, f"'{name}' must be {rule}, got {getattr(self, name)!r}")
        for token, bias in self.logit_bias:
            if vocab is not None and not 0 <= token < vocab:
                raise InvalidParam("logit_bias", f"'logit_bias' names token {token}, outside the vocabulary [0, {vocab})")
            if not math.isfinite(bias) or abs(bias) > MAX_LOGIT_BIAS:
                raise InvalidParam("logit_bias", f"'logit_bias' values must be between -100 and 100, got {bias!r}")
        if vocab is not None and any(not 0 <= t < vocab for t in self.stop_ids):
            raise InvalidParam("stop_token_ids", f"'stop_token_ids' must be token ids in [0, {vocab})")
        return self

    @property
    def processed(self) -> bool:
        """Whether any processor changes this request's logits (speculative decoding then steps plainly)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.min_tokens or self.logit_bias or self.grammar is not None)


@functools.cache
def mask_thread() -> ThreadPoolExecutor:
    """The thread on which grammars compute their next masks while the engine's forward runs (a mask depends only on
    the tokens accepted so far): 16 sequences' masks after the forward made a decode step 1.29x the unmasked one."""
    return ThreadPoolExecutor(1, thread_name_prefix="plait-grammar")


@functools.cache
def _executor():
    import llguidance

    return llguidance.LLExecutor(num_threads=1)  # one thread, as the mask thread was: the forward has the cores


def _fill(held: list, matchers: list, words: torch.Tensor, width: int) -> tuple[torch.Tensor, list]:
    """The tokens the matchers hold consumed (held: (Constrained, token)), then each matcher's next mask into its row
    of `words` (one bit a token, llguidance's layout); the masks as a logit bias, (rows, width) float (0 allowed, -inf
    banned: a byte's 8 tokens looked up at once), and the refused (Constrained, token). All of it in Rust or numpy,
    off the engine's thread: adding the bias is a vectorized add (0.2 ms for 16 rows of 23 k), where masked_fill
    with a bool mask took 0.6-1.6 ms."""
    ex = _executor()
    oks = ex.consume_token_par([(g.matcher, t) for g, t in held]) if held else []
    refused = [h for h, ok in zip(held, oks) if not ok]
    ex.unsafe_compute_mask_ptr(matchers, words.data_ptr(), words.shape[1] * 4, words.shape[0])
    bias = np.take(_BYTE_BIAS, words.numpy().view(np.uint8), axis=0).reshape(len(words), -1)[:, :width]
    return torch.from_numpy(bias), refused


# each byte of a mask as the logit bias of its 8 tokens (llguidance's bit order: the lowest bit the first token)
_BYTE_BIAS = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
                      np.float32(0), np.float32(-np.inf)).astype(np.float32)


class MaskBatch:
    """The next masks of several sequences' llguidance grammars in one call, on the mask thread while the step's
    forward runs: llguidance consumes the tokens the last step drew (`Processors.accept` holds them) and fills one
    int32 bitmask for all of them (in Rust, the interpreter lock released: 0.32 ms for 16 sequences of
    docs/serving.md's schema), unpacked there to a logit bias (0 or -inf); `apply` adds it to their logits rows at once."""

    def __init__(self, procs: list[Processors]):
        self.procs = procs
        width = procs[0]._width
        words = torch.zeros(len(procs), (width + 31) // 32, dtype=torch.int32)
        grammars = [p.grammar for p in procs]
        held = [(g, g.held.pop()) for g in grammars if g.held]  # type: ignore[union-attr]
        matchers = [(g.matcher, i) for i, g in enumerate(grammars)]  # type: ignore[union-attr]
        self.future: Future = mask_thread().submit(_fill, held, matchers, words, width)

    @classmethod
    def start(cls, procs: list[Processors]) -> MaskBatch | None:
        """A batch of the sequences that may use one (Processors.batchable) sharing one logits width, or None."""
        procs = [p for p in procs if p.batchable()]
        return cls([p for p in procs if p._width == procs[0]._width]) if procs else None

    def apply(self, rows: torch.Tensor, idx: list[int] | None = None) -> torch.Tensor:
        """Mask the batch's logits rows in place: rows[idx[i]] is the row of procs[i] (idx None: rows in order, one
        each); returns rows. ValueError when a grammar refused its held token (each sequence's own mask then says
        which); rows are then unchanged."""
        bias, refused = self.future.result()
        for grammar, token in refused:
            grammar.refused(token)
        if refused:
            raise ValueError("a grammar refused the token drawn")
        if idx is None or idx == list(range(rows.shape[0])):
            return rows.add_(bias)
        return rows.index_add_(0, torch.tensor(idx, dtype=torch.long), bias)


class Processors:
    """One sequence's logits processors (see the module's docstring); `accept` each token drawn. `prefetch` before
    the step's forward starts the grammar's mask for the next token on the mask thread; the call takes it."""

    def __init__(self, params: SamplingParams, prompt: list[int], vocab: int):
        self.params, self.vocab = params, vocab
        self.output = 0
        p = params
        self.bias: torch.Tensor | None = None
        if p.logit_bias:
            self.bias = torch.zeros(vocab)
            for token, value in p.logit_bias:
                self.bias[token] += value
        self.stops = torch.tensor(sorted(p.stop_ids), dtype=torch.long) if p.min_tokens and p.stop_ids else None
        self.seen: torch.Tensor | None = None  # prompt and output tokens (the repetition penalty)
        if p.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab, dtype=torch.bool)
            self.seen[torch.tensor(prompt, dtype=torch.long)] = True
        self.counts = torch.zeros(vocab) if p.presence_penalty or p.frequency_penalty else None  # output tokens
        self.grammar: TokenMask | None = p.grammar() if callable(p.grammar) else None
        self._width = 0  # the logits' width, known from the first call
        self._next: Future | None = None  # the next token's disallowed tokens, being computed on the mask thread

    def prefetch(self) -> None:
        if self.grammar is not None and self._width and self._next is None:
            self._next = mask_thread().submit(self._disallowed, self._width)

    def _disallowed(self, width: int) -> torch.Tensor | None:
        assert self.grammar is not None
        allowed = self.grammar.allowed(width)
        return None if allowed is None else ~allowed

    def batchable(self) -> bool:
        """Whether this sequence's next mask may come from a MaskBatch: an llguidance grammar whose logits' width is
        known (from the first call) and no mask of its own in flight."""
        g = self.grammar
        return (g is not None and hasattr(g, "matcher") and bool(self._width) and self._next is None
                and g.error is None and len(g.held) <= 1)  # type: ignore[attr-defined]

    def __call__(self, logits: torch.Tensor, masked: bool = False) -> torch.Tensor:
        """The logits the token is drawn from: (vocab,) float, a new tensor, or with masked (the grammar's mask is
        applied already: MaskBatch.apply) `logits` itself, changed in place."""
        p = self.params
        out = logits.float() if masked else logits.float().clone()
        if self.bias is not None:
            out[:self.vocab] += self.bias
        if self.stops is not None and self.output < p.min_tokens:
            out[self.stops] = float("-inf")
        if self.seen is not None:
            seen = out[:self.vocab][self.seen]
            out[:self.vocab][self.seen] = torch.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty)
        if self.counts is not None:
            out[:self.vocab] -= p.frequency_penalty * self.counts + p.presence_penalty * (self.counts > 0).float()
        if self.grammar is not None and not masked:
            pending, self._next = self._next, None
            if self._width != out.shape[-1]:  # the first call (or a mask of another width): computed here
                if pending is not None:  # the matcher is free once a mask in flight is done
                    pending.result()
                self._width, pending = out.shape[-1], None
            banned = pending.result() if pending is not None else self._disallowed(self._width)
            if banned is not None:
                out = out.masked_fill(banned, float("-inf"))
        return out

    def accept(self, token: int) -> None:
        self.output += 1
        if self.seen is not None and token < self.vocab:
            self.seen[token] = True
        if self.counts is not None and token < self.vocab:
            self.counts[token] += 1
        if self.grammar is not None:
            pending, self._next = self._next, None
            if pending is not None:  # a mask computed for the state this token changes: the matcher is free after it
                pending.result()
            if hasattr(self.grammar, "hold") and self._width:  # consumed by the next MaskBatch, off this thread
                self.grammar.hold(token)
            else:
                self.grammar.accept(token)
