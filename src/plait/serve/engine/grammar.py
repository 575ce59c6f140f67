"""Structured output: a grammar over the model's tokens (llguidance), applied as a token mask in the sampler.

    grammars = Grammars.of_model(tokenizer_json, vocab, eos_ids)       # once per served model and process
    params = SamplingParams(..., grammar=grammars.factory("json_schema", schema))   # per request: compiled once
    # the engine calls the factory once per sequence and masks each step's logits with its matcher

Kinds: "json_schema" (a JSON schema), "json_object" (any JSON object), "regex", "choice" (one of a list of strings)
and "lark" (a Lark grammar, llguidance's syntax). A grammar compiles once per (kind, spec) and each sequence takes a
copy of the compiled matcher (a cache of the last 256). When the grammar is complete its mask allows only the stop
tokens. llguidance was picked by measure (benchmarks/grammar_cost.py, docs/serving.md): compiles in 1-3 ms where
xgrammar takes 13-136 ms and outlines-core 0.3-17 s, one 7.6 MB wheel with no dependencies, and a mask and advance
of 9-36 us per token, well under 1 % of a decode step.
"""

from __future__ import annotations

import collections
import hashlib
import json
import threading
from dataclasses import dataclass

import numpy as np
import torch

from plait.extras import install_command

KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
INSTALL = f"{install_command('structured')} (llguidance)"


class GrammarError(ValueError):
    """A grammar that does not compile (a bad schema or regex): the message says what."""


# The grammars of the models this process serves, by their tokenizer's key: a GrammarRef that crossed a pipe to a
# replica finds its model's grammars here (the replica registered them when it built its engine).
_REGISTRY: dict[str, Grammars] = {}


@dataclass(frozen=True)
class GrammarRef:
    """A compiled grammar as SamplingParams.grammar holds it: picklable (a few strings), so a request with structured
    output crosses to a replica, which compiles it there once; called, one sequence's matcher."""

    key: str
    kind: str
    spec: object

    def __call__(self) -> Constrained:
        grammars = _REGISTRY.get(self.key)
        if grammars is None:
            raise ValueError("structured output: this process serves no model with that tokenizer")
        return grammars.matcher(self.kind, self.spec)


class Constrained:
    """One sequence's matcher (plait.serve.engine.sampling.TokenMask). A token accepted with `hold` is consumed by
    the next batch of masks (sampling.MaskBatch, off the engine's thread, before it computes the next mask) or by
    the next call here, whichever comes first."""

    def __init__(self, matcher):
        self.matcher = matcher
        self.held: list[int] = []  # accepted, not yet consumed by the matcher
        self.error: str | None = None  # the first token the grammar refused

    def allowed(self, vocab: int) -> torch.Tensor:
        self._consume_held()
        words = np.zeros((vocab + 31) // 32, dtype=np.int32)
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        bits = np.unpackbits(words.view(np.uint8), count=vocab, bitorder="little")
        return torch.from_numpy(bits.view(np.bool_))

    def accept(self, token: int) -> None:
        self._consume_held()
        self.consumed(token, self.matcher.consume_token(token))

    def hold(self, token: int) -> None:
        self.held.append(token)

    def consumed(self, token: int, ok: bool) -> None:
        """Record whether the matcher took `token`; ValueError once it refused one."""
        if not ok:
            self.refused(token)
        if self.error is not None:
            raise ValueError(self.error)

    def refused(self, token: int) -> None:
        """The matcher refused `token` (here or in a batch): an error from now on."""
        if self.error is None:
            self.error = f"the grammar refused token {token}: {self.matcher.get_error()}"

    def _consume_held(self) -> None:
        if self.error is not None:
            raise ValueError(self.error)
        held, self.held = self.held, []
        for token in held:
            self.consumed(token, self.matcher.consume_token(token))

    def finished(self) -> bool:
        self._consume_held()
        return self.matcher.is_stopped()


class Grammars:
    """The grammars of one served model: its tokenizer as llguidance reads it (built on first use, about a second),
    and the compiled matchers, each compiled once."""

    def __init__(self, tokenizer_json: str, vocab: int, eos_ids: frozenset[int], size: int = 256):
        self.tokenizer_json, self.vocab, self.eos_ids, self.size = tokenizer_json, vocab, sorted(eos_ids), size
        self.key = self.key_of(tokenizer_json, vocab, eos_ids)
        self._tokenizer = None
        self._compiled: collections.OrderedDict[str, object] = collections.OrderedDict()
        self._lock = threading.Lock()  # requests compile from the server's worker threads

    @staticmethod
    def key_of(tokenizer_json: str, vocab: int, eos_ids: frozenset[int]) -> str:
        return hashlib.sha256(f"{tokenizer_json}|{vocab}|{sorted(eos_ids)}".encode()).hexdigest()[:24]

    @classmethod
    def of_model(cls, tokenizer_json: str, vocab: int, eos_ids: frozenset[int]) -> Grammars:
        """This process's grammars for the model with that tokenizer (made and registered on first use)."""
        key = cls.key_of(tokenizer_json, vocab, eos_ids)
        if key not in _REGISTRY:
            _REGISTRY[key] = cls(tokenizer_json, vocab, eos_ids)
        return _REGISTRY[key]

    def _llg(self):
        try:
            import llguidance
        except ImportError:
            raise GrammarError(f"structured output needs llguidance: {INSTALL}") from None
        if self._tokenizer is None:
            try:
                self._tokenizer = llguidance.LLTokenizer(self.tokenizer_json, n_vocab=self.vocab,
                                                         eos_token=self.eos_ids or None)
            except Exception as e:  # llguidance's Rust errors: a tokenizer.json it cannot read token bytes from
                raise GrammarError(f"structured output cannot read this model's tokenizer.json (llguidance: "
                                   f"{str(e)[:200]}); it needs a tokenizer with a decoder (byte-level BPE, "
                                   "SentencePiece)") from None
        return llguidance

    def factory(self, kind: str, spec) -> GrammarRef:
        """What gives each sequence its own matcher for (kind, spec), compiled here first (GrammarError when it does
        not compile) and picklable."""
        if kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {kind!r}; one of {', '.join(KINDS)}")
        self._template(kind, spec)
        _REGISTRY.setdefault(self.key, self)
        return GrammarRef(self.key, kind, spec)

    def matcher(self, kind: str, spec) -> Constrained:
        return Constrained(self._template(kind, spec).deep_copy())

    def _template(self, kind: str, spec):
        key = json.dumps([kind, spec], sort_keys=True)
        with self._lock:
            template = self._compiled.get(key)
            if template is None:
                template = self._compile(kind, spec)
                self._compiled[key] = template
                if len(self._compiled) > self.size:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(key)
        return template

    def _compile(self, kind: str, spec):
        llg = self._llg()
        matcher_type = llg.LLMatcher
        try:
            if kind in ("json_schema", "json_object"):
                schema = spec if kind == "json_schema" else {"type": "object"}
                # compact JSON unless the schema says otherwise: a small model may otherwise spend its tokens on spaces
                grammar = matcher_type.grammar_from_json_schema({"x-guidance": COMPACT} | schema)
            elif kind == "regex":
                grammar = matcher_type.grammar_from_regex(spec)
            elif kind == "choice":
                grammar = llg.grammar_from("choice", json.dumps(spec))
            else:
                grammar = matcher_type.grammar_from_lark(spec)
        except Exception as e:  # llguidance's parse errors: ValueError and its Rust errors
            raise GrammarError(f"the {kind.replace('_', ' ')} does not compile: {str(e).strip()[:300]}") from None
        matcher = matcher_type(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the {kind.replace('_', ' ')} does not compile: {matcher.get_error()[:300]}")
        return matcher
