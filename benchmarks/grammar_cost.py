"""Structured output's cost per token: xgrammar, llguidance and outlines-core side by side (issue 55 item 4).

    .venv/bin/python benchmarks/grammar_cost.py [--vocab 32000,128000] [--libs xgrammar,llguidance,outlines-core]
        [--kinds json_schema,json_object,regex,choice] [--reps 8] [--samples 20] [--batch 16] [--threads 1]
        [--torch-threads 1] [--cache /tmp/plait_grammar_cost] [--no-compiled-kernels] [--no-model]

No hub is reachable, so the tokenizer is made here: a byte-level BPE (the `tokenizers` library, as GPT-2's
and Llama 3's) trained on the repository's and the venv's .py/.md files to --vocab entries (32,000 is
Llama 2's size, 128,000 Llama 3's), with <s> and </s> (the eos) as special tokens, wrapped as a
transformers.PreTrainedTokenizerFast; it is kept under --cache (training: about 20 s for 32k, 70 s for 128k).

For each library and constraint (a JSON schema with a string, an integer, an enum, an array of numbers and a
nested object, additionalProperties false; json_object, any JSON object, as the schema {"type": "object"};
an ISO date regex; a choice among three strings) it measures:

    compile    the grammar compiled for the tokenizer, first and second time (xgrammar's compiler caches;
               llguidance builds its lexer lazily, so its compile is small and its first output slower;
               outlines-core builds the whole token index up front), and a per-sequence matcher made from it
    mask+adv   per token: the library fills an int32 bitmask of the allowed tokens (its own call), then
               advances by the chosen token; median and p99 over the whole outputs after the first (--reps in
               all), each from a fresh matcher. The token is chosen the same way for every library: the longest allowed token that a
               fixed valid target string continues with (the eos once the target is done). "cold" is the mean
               of the first output from a freshly compiled grammar
    batch      the same for --batch sequences at once (16 different targets), through the library's batched
               calls (xgrammar's BatchGrammarMatcher, llguidance's LLExecutor; outlines-core has none, so a
               loop), in microseconds per sequence per step
    apply      setting the forbidden logits of a (vocab,) and (batch, vocab) float32 tensor to -inf: torch
               masked_fill_ from a bool mask, the bitmask unpacked to bool (torch ops, or numpy.unpackbits) then
               masked_fill_, and each library's apply_token_bitmask_inplace (xgrammar: a C++ CPU kernel;
               llguidance and outlines-core: torch.compile'd, whose first call compiles), next to an unmasked
               step for scale: torch.argmax, plait's sampler (plait.models.sampling.sample at temperature 1),
               and plait's Llama (width 256, 4 layers) decoding one token; the last lines put the json_schema
               mask+adv and a bool fill beside that step (the issue's target: a masked step <= 1.1x an unmasked)

Correctness: every target output, and --samples random walks per library and constraint (uniformly random
allowed tokens for 24 steps, then closing: the eos, else a token made of '"', ']' and '}', else ':' or '0',
else the lowest allowed id; at most 256 steps), is decoded as strict UTF-8 and checked: json.loads and
jsonschema.validate for the schema, a dict for json_object, re.fullmatch for the regex, membership for the
choice; json_object must also take a valid object nested five deep ("deep ok"). The column reads
"targets valid/reps, walks valid/finished of --samples". Everything runs in this one process, on the CPU; the
load average is printed beside each row.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import time
from pathlib import Path

import numpy as np
import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
        "scores": {"type": "array", "items": {"type": "number"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "scores", "address"],
    "additionalProperties": False,
}
OBJECT_SCHEMA = {"type": "object"}
DATE = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
CHOICES = ["positive", "negative", "neutral"]
KINDS = ("json_schema", "json_object", "regex", "choice")
LIBS = ("xgrammar", "llguidance", "outlines-core")
FREE_STEPS, MAX_STEPS = 24, 256


def targets(kind: str, n: int) -> list[str]:
    """n valid outputs of constraint `kind`, all different, compact JSON (every library's default accepts it)."""
    names = ["Ada Lovelace", "Grace Hopper", "Alan Turing", "Edsger W. Dijkstra", "Barbara Liskov", "Donald Knuth",
             "Frances Allen", "Ken Thompson", "Margaret Hamilton", "John McCarthy", "Radia Perlman", "Leslie Lamport",
             "Fran\u00e7oise Barr\u00e9-Sinoussi", "Tony Hoare", "Niklaus Wirth", "Shafi Goldwasser"]
    cities = ["London", "New York", "Paris", "Z\u00fcrich", "Tokyo", "S\u00e3o Paulo", "Berlin", "Austin"]
    out = []
    for i in range(n):
        if kind == "json_schema":
            obj = {"name": names[i % len(names)], "age": 20 + 7 * i, "role": ["admin", "user", "guest"][i % 3],
                   "scores": [round(0.5 * i + 1.25, 2), -3, 1e-3 * (i + 1), 42 + i][: 1 + i % 4],
                   "address": {"city": cities[i % len(cities)], "zip": f"{10000 + 137 * i}"}}
        elif kind == "json_object":
            obj = {"id": i, "tags": ["alpha", "beta", "gamma"][: i % 3 + 1], "ok": i % 2 == 0, "note": None,
                   "meta": {"source": names[i % len(names)], "weight": -1.5 * i, "k": [1, 2, 3]}}
        elif kind == "regex":
            return [f"{1990 + 3 * j}-{1 + j % 12:02d}-{1 + (5 * j) % 31:02d}" for j in range(n)]
        else:
            return [CHOICES[j % 3] for j in range(n)]
        out.append(json.dumps(obj, separators=(",", ":"), ensure_ascii=False))
    return out


DEEP = '{"a":{"b":{"c":{"d":{"e":[1]}}}}}'  # valid for json_object, deeper than outlines-core's regex (depth 3)


def check(kind: str, text: str) -> str | None:
    """None when `text` satisfies constraint `kind`, else why not."""
    import jsonschema

    try:
        if kind == "json_schema":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif kind == "json_object":
            if not isinstance(json.loads(text), dict):
                return "not an object"
        elif kind == "regex":
            if not re.fullmatch(DATE, text):
                return "no fullmatch"
        elif text not in CHOICES:
            return "not a choice"
    except Exception as e:  # noqa: BLE001 - any parse or validation error is the answer
        return f"{type(e).__name__}: {str(e)[:80]}"
    return None


# ---------------------------------------------------------------- tokenizer

def corpus(limit_bytes: float):
    """Text of the repo's and the venv's .py and .md files, in a fixed order, up to about `limit_bytes`."""
    import site

    root = Path(__file__).resolve().parent.parent
    dirs = [root / "src", root / "docs", root / "tests", root / "benchmarks", *map(Path, site.getsitepackages())]
    n = 0
    for d in dirs:
        for dirpath, dirnames, filenames in os.walk(d):
            dirnames.sort()
            for f in sorted(filenames):
                if not f.endswith((".py", ".md")):
                    continue
                try:
                    text = (Path(dirpath) / f).read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue
                n += len(text)
                yield text
                if n > limit_bytes:
                    return


def tokenizer(vocab: int, cache: Path):
    """A byte-level BPE of `vocab` entries (<s> 0, </s> 1 = eos), trained once and kept in `cache`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = cache / f"bpe-{vocab}.json"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(corpus(max(30e6, vocab * 800)), trainer)
        tok.save(str(path))
        print(f"trained a {tok.get_vocab_size()}-token byte-level BPE in {time.perf_counter() - t0:.0f} s -> {path}",
              flush=True)
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(path)), bos_token="<s>", eos_token="</s>")


def token_bytes(hf) -> list[bytes | None]:
    """Each id's bytes (None for special tokens): the byte-level alphabet mapped back to bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    shifted = [b for b in range(256) if b not in printable]
    back = {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(shifted)}  # GPT-2's byte-level map
    special = set(hf.all_special_ids)
    out: list[bytes | None] = [None] * len(hf)
    for s, i in hf.get_vocab().items():
        out[i] = None if i in special else bytes(back[c] for c in s)
    return out


# ---------------------------------------------------------------- the three libraries, one interface

class XGrammar:
    name, batched = "xgrammar", True

    def __init__(self, hf, tb, eos, vocab, threads):
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=True)
        self.batcher = xgr.BatchGrammarMatcher(threads)

    def compile(self, kind):
        c = self.compiler
        if kind == "json_schema":
            return c.compile_json_schema(json.dumps(SCHEMA))
        if kind == "json_object":
            return c.compile_json_schema(json.dumps(OBJECT_SCHEMA))
        if kind == "regex":
            return c.compile_regex(DATE)
        return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in CHOICES))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, bitmask, i):
        m.fill_next_token_bitmask(bitmask, i)

    def accept(self, m, t):
        return m.accept_token(t)

    def finished(self, m):
        return m.is_terminated()

    def fill_batch(self, ms, bitmask):
        self.batcher.batch_fill_next_token_bitmask(ms, bitmask)

    def accept_batch(self, ms, toks):
        return self.xgr.BatchGrammarMatcher.batch_accept_token(ms, toks)


class LLGuidance:
    name, batched = "llguidance", True

    def __init__(self, hf, tb, eos, vocab, threads):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.llt = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=eos)
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, kind):
        M = self.llg.LLMatcher
        if kind == "json_schema":
            g = M.grammar_from_json_schema(SCHEMA)
        elif kind == "json_object":
            g = M.grammar_from_json_schema(OBJECT_SCHEMA)
        elif kind == "regex":
            g = M.grammar_from_regex(DATE)
        else:
            g = self.llg.grammar_from("choice", json.dumps(CHOICES))
        m = M(self.tok, g)  # the template: each sequence's matcher is a deep copy (sharing its lexer)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, bitmask, i):
        self.llt.fill_next_token_bitmask(m, bitmask, i)

    def accept(self, m, t):
        return m.consume_token(t)

    def finished(self, m):
        return m.is_stopped() and not m.is_error()

    def fill_batch(self, ms, bitmask):
        self.llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)], bitmask)

    def accept_batch(self, ms, toks):
        return self.llt.consume_token_par(self.executor, list(zip(ms, toks)))


class OutlinesCore:
    name, batched = "outlines-core", False

    def __init__(self, hf, tb, eos, vocab, threads):
        import outlines_core

        self.oc = outlines_core
        words: dict[bytes, list[int]] = {}
        for i, b in enumerate(tb):
            if b is not None:
                words.setdefault(b, []).append(i)
        self.vocab, self.eos = outlines_core.Vocabulary(eos, words), eos

    def compile(self, kind):
        build = self.oc.json_schema.build_regex_from_schema
        if kind == "json_schema":
            regex = build(json.dumps(SCHEMA))
        elif kind == "json_object":
            regex = build(json.dumps(OBJECT_SCHEMA))  # a regex: objects nest to depth 3 at most
        elif kind == "regex":
            regex = DATE
        else:
            regex = "(" + "|".join(re.escape(s) for s in CHOICES) + ")"
        return self.oc.Index(regex, self.vocab)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def fill(self, m, bitmask, i):
        row = bitmask[i]
        m.write_mask_into(row.data_ptr(), row.numel(), 4)

    def accept(self, m, t):
        if t == self.eos:  # the eos is allowed in a final state but is no transition: the caller ends there
            return m.is_finished()
        try:
            m.advance(t, return_tokens=False)
            return True
        except ValueError:
            return False

    def finished(self, m):
        return m.is_finished()

    def fill_batch(self, ms, bitmask):
        for i, m in enumerate(ms):
            self.fill(m, bitmask, i)

    def accept_batch(self, ms, toks):
        return [self.accept(m, t) for m, t in zip(ms, toks)]


ADAPTERS = {"xgrammar": XGrammar, "llguidance": LLGuidance, "outlines-core": OutlinesCore}


# ---------------------------------------------------------------- choosing tokens (untimed)

class Chooser:
    def __init__(self, tb: list[bytes | None], eos: int, vocab: int):
        self.tb, self.eos, self.vocab = tb, eos, vocab
        self.by_bytes = {b: i for i, b in enumerate(tb) if b is not None}
        self.longest = max(len(b) for b in self.by_bytes)
        self.closers = np.array([i for i, b in enumerate(tb) if b and set(b) <= set(b'"]}')], dtype=np.int64)
        self.seconds = np.array([i for i, b in enumerate(tb) if b in (b":", b"0")], dtype=np.int64)

    @staticmethod
    def allowed(words: np.ndarray, t: int) -> bool:
        return bool((int(words[t >> 5]) >> (t & 31)) & 1)

    def follow(self, words: np.ndarray, target: bytes, pos: int) -> int | None:
        """The longest allowed token that target[pos:] starts with; the eos once the target is done."""
        if pos == len(target):
            return self.eos if self.allowed(words, self.eos) else None
        for n in range(min(self.longest, len(target) - pos), 0, -1):
            t = self.by_bytes.get(target[pos:pos + n])
            if t is not None and self.allowed(words, t):
                return t
        return None

    def all_allowed(self, words: np.ndarray) -> np.ndarray:
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[: self.vocab]
        return np.flatnonzero(bits)

    def walk(self, words: np.ndarray, step: int, rng: np.random.Generator) -> int:
        """A random allowed token for FREE_STEPS steps, then one that closes the output."""
        ok = self.all_allowed(words)
        if len(ok) == 0:
            raise RuntimeError("the mask allows nothing")
        eos_ok = self.allowed(words, self.eos)
        if step < FREE_STEPS:
            return self.eos if eos_ok and rng.random() < 0.25 else int(rng.choice(ok))
        if eos_ok:
            return self.eos
        for pool in (self.closers, self.seconds):
            hit = pool[np.isin(pool, ok, assume_unique=True)]
            if len(hit):
                return int(hit[0])
        return int(ok[0])


# ---------------------------------------------------------------- measurements

def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def follow_one(lib, m, ch: Chooser, target: bytes, bitmask: torch.Tensor, words: np.ndarray):
    """Generate `target` through matcher `m`; per-token (fill, accept) ns and the tokens."""
    pos, fills, accepts, toks = 0, [], [], []
    while True:
        t0 = time.perf_counter_ns()
        lib.fill(m, bitmask, 0)
        t1 = time.perf_counter_ns()
        tok = ch.follow(words, target, pos)
        if tok is None:
            raise RuntimeError(f"{lib.name} forbids {target[pos:pos + 24]!r} at byte {pos} of {target[:60]!r}")
        t2 = time.perf_counter_ns()
        ok = lib.accept(m, tok)
        t3 = time.perf_counter_ns()
        if not ok:
            raise RuntimeError(f"{lib.name} refused token {tok} it allowed")
        fills.append(t1 - t0)
        accepts.append(t3 - t2)
        toks.append(tok)
        if tok == ch.eos:
            return fills, accepts, toks
        pos += len(ch.tb[tok])


def text_of(ch: Chooser, toks: list[int]) -> str:
    return b"".join(ch.tb[t] for t in toks if t != ch.eos).decode("utf-8")  # strict: a bad byte is a failure


def batch_run(lib, compiled, ch: Chooser, tgts: list[bytes], vocab: int, batched: bool) -> list[float]:
    """All targets at once; µs per sequence per step, batched calls or a loop of single ones."""
    n = len(tgts)
    ms = [lib.matcher(compiled) for _ in tgts]
    pos, active = [0] * n, list(range(n))
    bitmask = torch.full((n, (vocab + 31) // 32), -1, dtype=torch.int32)
    rows = bitmask.numpy()
    per_seq = []
    while active:
        sub = [ms[i] for i in active]
        t0 = time.perf_counter_ns()
        if batched:
            lib.fill_batch(sub, bitmask)
        else:
            for k, m in enumerate(sub):
                lib.fill(m, bitmask, k)
        t1 = time.perf_counter_ns()
        toks = [ch.follow(rows[k], tgts[i], pos[i]) for k, i in enumerate(active)]
        if None in toks:
            raise RuntimeError(f"{lib.name}: batch target forbidden")
        t2 = time.perf_counter_ns()
        if batched:
            oks = lib.accept_batch(sub, toks)
        else:
            oks = [lib.accept(m, t) for m, t in zip(sub, toks)]
        t3 = time.perf_counter_ns()
        if not all(oks):
            raise RuntimeError(f"{lib.name}: batch accept refused")
        per_seq.append((t1 - t0 + t3 - t2) / 1e3 / len(active))
        for i, t in zip(active, toks):
            pos[i] += 0 if t == ch.eos else len(ch.tb[t])
        active = [i for i, t in zip(active, toks) if t != ch.eos]
    return per_seq


def samples(lib, compiled, ch: Chooser, kind: str, n: int, vocab: int, seed: int) -> tuple[int, int, list[str]]:
    """n random walks: (finished, valid among finished, the first few failures)."""
    rng = np.random.default_rng(seed)
    bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    words = bitmask.numpy()[0]
    done = valid = 0
    bad: list[str] = []
    for _ in range(n):
        m, toks = lib.matcher(compiled), []
        for step in range(MAX_STEPS):
            lib.fill(m, bitmask, 0)
            t = ch.walk(words, step, rng)
            if not lib.accept(m, t):
                bad.append(f"refused its own allowed token {t}")
                break
            toks.append(t)
            if t == ch.eos:
                break
        if not toks or toks[-1] != ch.eos:
            continue
        done += 1
        try:
            why = check(kind, text_of(ch, toks))
        except UnicodeDecodeError as e:
            why = f"bad UTF-8: {e}"
        if why is None:
            valid += 1
        elif len(bad) < 3:
            bad.append(f"{why} in {b''.join(ch.tb[t] for t in toks if t != ch.eos)[:100]!r}")
    return done, valid, bad


def timeit_us(fn, n: int) -> float:
    fn()
    xs = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        xs.append(time.perf_counter_ns() - t0)
    return statistics.median(xs) / 1e3


def sample(logits: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """plait's own draw at temperature 1 (plait.models.sampling.sample: softmax, torch.multinomial)."""
    try:
        from plait.models.sampling import sample as plait_sample
    except ImportError:
        return torch.multinomial(torch.softmax(logits, -1), 1, generator=g)
    return plait_sample(logits, 1.0, generator=g)


def apply_costs(vocab: int, batch: int, libs: list[str], compiled_kernels: bool) -> list[tuple[int, dict[str, str]]]:
    """Unmasked argmax/sampling and each way of applying a mask, (1, vocab) and (batch, vocab) float32."""
    return [(b, apply_row(vocab, b, libs, compiled_kernels)) for b in (1, batch)]


def apply_row(vocab: int, b: int, libs: list[str], compiled_kernels: bool) -> dict[str, str]:
    """One row of apply_costs: median µs of each way, on (b, vocab) logits with 10% of the tokens allowed."""
    g = torch.Generator().manual_seed(0)
    shifts = torch.arange(32, dtype=torch.int32)
    logits = torch.randn(b, vocab, generator=g)
    allowed = torch.rand(b, vocab, generator=g) < 0.1
    bits = torch.zeros(b, (vocab + 31) // 32 * 32, dtype=torch.bool)
    bits[:, :vocab] = allowed
    packed = np.packbits(bits.numpy(), axis=1, bitorder="little").view(np.int32)
    bitmask = torch.from_numpy(packed.copy())
    row: dict[str, str] = {}
    row["argmax"] = f"{timeit_us(lambda: torch.argmax(logits, -1), 200):.1f}"
    row["sample"] = f"{timeit_us(lambda: sample(logits, g), 200):.1f}"
    row["bool fill"] = f"{timeit_us(lambda: logits.masked_fill_(~allowed, float('-inf')), 200):.1f}"

    def unpack_fill():
        mask = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().view(b, -1)[:, :vocab]
        logits.masked_fill_(~mask, float("-inf"))

    row["unpack+fill"] = f"{timeit_us(unpack_fill, 200):.1f}"

    def np_unpack_fill():
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=vocab, bitorder="little").view(np.bool_)
        logits.masked_fill_(~torch.from_numpy(bits), float("-inf"))

    row["np unpack+fill"] = f"{timeit_us(np_unpack_fill, 200):.1f}"
    for name in libs:
        try:
            if name == "xgrammar":
                import xgrammar as xgr

                apply = xgr.apply_token_bitmask_inplace
            elif not compiled_kernels:
                continue
            elif name == "llguidance":
                import llguidance.torch as llt

                apply = llt.apply_token_bitmask_inplace
            else:
                import outlines_core.kernels.torch as oct

                apply = oct.apply_token_bitmask_inplace
            fn = lambda: apply(logits, bitmask)  # noqa: B023, E731
            t0 = time.perf_counter()
            fn()
            first = time.perf_counter() - t0
            zeros = torch.zeros(b, vocab)
            apply(zeros, bitmask)
            assert torch.equal(torch.isfinite(zeros), allowed), f"{name} masks the wrong logits"
            row[name] = f"{timeit_us(fn, 200):.1f}" + (f" (1st {first:.1f} s)" if first > 0.1 else "")
        except Exception as e:  # noqa: BLE001 - reported in the table
            row[name] = f"failed: {type(e).__name__}"
    return row


def model_step_us(vocab: int, batch: int) -> dict[int, float]:
    """plait's Llama (width 256, 4 layers, 4 heads) decoding one token per sequence after a 32-token prompt."""
    from plait.models.llama import Llama

    torch.manual_seed(0)
    model = Llama(vocab, context=512, width=256, heads=4, layers=4).eval()
    out = {}
    with torch.inference_mode():
        for b in (1, batch):
            cache: dict = {}
            nxt = model(torch.randint(2, vocab, (b, 32)), cache=cache)[:, -1].argmax(-1, keepdim=True)
            xs = []
            for i in range(24):
                t0 = time.perf_counter_ns()
                nxt = model(nxt, cache=cache)[:, -1].argmax(-1, keepdim=True)
                if i >= 4:
                    xs.append(time.perf_counter_ns() - t0)
            out[b] = statistics.median(xs) / 1e3
    return out


def load() -> str:
    return f"{os.getloadavg()[0]:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", default="32000,128000")
    p.add_argument("--libs", default=",".join(LIBS))
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--reps", type=int, default=8, help="whole outputs per library and constraint (fresh matchers)")
    p.add_argument("--samples", type=int, default=20, help="random walks per library and constraint (correctness)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="threads of the libraries' batched calls")
    p.add_argument("--torch-threads", type=int, default=1, help="torch's threads (2 on a loaded 2-core machine: "
                   "a (16, vocab) argmax waits milliseconds for the second thread)")
    p.add_argument("--cache", type=Path, default=Path("/tmp/plait_grammar_cost"))
    p.add_argument("--no-compiled-kernels", action="store_true", help="skip llguidance's and outlines-core's "
                   "torch.compile'd apply_token_bitmask_inplace (the first call compiles: 3-4 s here)")
    p.add_argument("--no-model", action="store_true", help="skip plait's Llama decode step")
    a = p.parse_args()
    libs, kinds = a.libs.split(","), a.kinds.split(",")
    torch.set_num_threads(a.torch_threads)
    print(f"load average {load()}, {os.cpu_count()} CPUs, torch {torch.__version__} on {a.torch_threads} threads, "
          f"the libraries' batched calls on {a.threads}", flush=True)
    summary = []
    for vocab_req in map(int, a.vocab.split(",")):
        hf = tokenizer(vocab_req, a.cache)
        vocab, eos = len(hf), hf.eos_token_id
        tb = token_bytes(hf)
        ch = Chooser(tb, eos, vocab)
        tgts = {k: [t.encode() for t in targets(k, max(a.reps, a.batch))] for k in kinds}
        n_tok = {k: statistics.mean(len(hf(t.decode())["input_ids"]) for t in tgts[k]) for k in kinds}
        print(f"\nvocab {vocab} (eos {eos}); target outputs' mean BPE length: "
              + ", ".join(f"{k} {n_tok[k]:.1f}" for k in kinds), flush=True)
        print(f"{'library':<14}{'constraint':<12}{'compile ms':>15}{'matcher':>9}{'tok':>5}{'fill':>7}{'adv':>7}"
              f"{'mask+adv med/p99':>18}{'cold':>7}{'batch' + str(a.batch):>9}{'loop':>7}  {'correct: targets, walks':<34}load",
              flush=True)
        print(f"{'':<26}{'1st / 2nd':>15}{'µs':>9}{'':>5}{'µs':>7}{'µs':>7}{'µs':>18}{'µs':>7}{'µs/seq':>9}"
              f"{'µs/seq':>7}", flush=True)
        for name in libs:
            t0 = time.perf_counter()
            lib = ADAPTERS[name](hf, tb, eos, vocab, a.threads)
            print(f"{name}: tokenizer set up in {(time.perf_counter() - t0) * 1e3:.0f} ms", flush=True)
            for kind in kinds:
                try:
                    t0 = time.perf_counter()
                    lib.compile(kind)
                    t1 = time.perf_counter()
                    compiled = lib.compile(kind)
                    t2 = time.perf_counter()
                    matcher_us = timeit_us(lambda c=compiled, lib=lib: lib.matcher(c), 50)
                    bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
                    words = bitmask.numpy()[0]
                    fills, accepts, totals, cold, bad = [], [], [], 0.0, []
                    gc.disable()
                    for r in range(a.reps):
                        f, acc, toks = follow_one(lib, lib.matcher(compiled), ch, tgts[kind][r], bitmask, words)
                        if r == 0:  # the first output from the grammar: llguidance builds its lexer states here
                            cold = (sum(f) + sum(acc)) / len(f) / 1e3
                        if r > 0 or a.reps == 1:
                            fills += f
                            accepts += acc
                            totals += [(x + y) / 1e3 for x, y in zip(f, acc)]
                        why = check(kind, text_of(ch, toks))
                        if why:
                            bad.append(why)
                    batched = batch_run(lib, compiled, ch, tgts[kind][: a.batch], vocab, lib.batched)
                    loop = batch_run(lib, compiled, ch, tgts[kind][: a.batch], vocab, False) if lib.batched else batched
                    gc.enable()
                    done, valid, wbad = samples(lib, compiled, ch, kind, a.samples, vocab, seed=1)
                    med = statistics.median(totals)
                    ok = f"{a.reps - len(bad)}/{a.reps} tgt, {valid}/{done} of {a.samples}"
                    if kind == "json_object":
                        try:
                            follow_one(lib, lib.matcher(compiled), ch, DEEP.encode(), bitmask, words)
                            ok += ", deep ok"
                        except RuntimeError:
                            ok += ", DEEP NO"
                            wbad.append(f"refuses the valid depth-5 object {DEEP}")
                    print(f"{name:<14}{kind:<12}{(t1 - t0) * 1e3:>8.1f} /{(t2 - t1) * 1e3:>5.1f}{matcher_us:>9.1f}"
                          f"{len(totals) / max(1, a.reps - 1):>5.0f}{statistics.median(fills) / 1e3:>7.1f}"
                          f"{statistics.median(accepts) / 1e3:>7.1f}{med:>10.1f} /{pct(totals, 0.99):>6.1f}{cold:>7.1f}"
                          f"{statistics.median(batched):>9.1f}{statistics.median(loop):>7.1f}  {ok:<34}{load()}",
                          flush=True)
                    for why in bad[:2] + wbad:
                        print(f"    ! {name} {kind}: {why}", flush=True)
                    summary.append((vocab, name, kind, med, statistics.median(batched)))
                except Exception as e:  # noqa: BLE001 - one library's failure is a row, not the end of the run
                    gc.enable()
                    print(f"{name:<14}{kind:<12}failed: {type(e).__name__}: {str(e)[:150]}  {load()}", flush=True)
        print(f"\napplying a mask to float32 logits, median µs (vocab {vocab}; 10% of tokens allowed)", flush=True)
        cols = ["argmax", "sample", "bool fill", "unpack+fill", "np unpack+fill", *libs]
        print(f"{'batch':>6}" + "".join(f"{c:>19}" for c in cols) + "  load", flush=True)
        applied = {}
        for b, row in apply_costs(vocab, a.batch, libs, not a.no_compiled_kernels):
            applied[b] = row
            print(f"{b:>6}" + "".join(f"{row.get(c, '-'):>19}" for c in cols) + f"  {load()}", flush=True)
        if not a.no_model:
            steps = model_step_us(vocab, a.batch)
            print(f"plait's Llama (width 256, 4 layers, vocab {vocab}) decode step + argmax: "
                  + ", ".join(f"batch {b} {us:.0f} µs ({us / b:.0f} µs/seq)" for b, us in steps.items())
                  + f"  load {load()}", flush=True)
            fill1 = float(applied[1]["bool fill"])
            for v, name, kind, med, bmed in summary:
                if v == vocab and kind == "json_schema":
                    print(f"  {name}: json_schema mask+adv {med:.1f} µs + bool fill {fill1:.1f} µs = "
                          f"{(med + fill1) / steps[1] * 100:.1f}% of the batch-1 step; batched {bmed:.1f} µs/seq = "
                          f"{bmed / (steps[a.batch] / a.batch) * 100:.1f}% of the batch-{a.batch} step per sequence",
                          flush=True)


if __name__ == "__main__":
    main()
