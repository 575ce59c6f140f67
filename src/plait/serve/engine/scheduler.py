"""The continuous-batching scheduler: a pure policy over sequences and KV-cache blocks (no tensors, no threads).

Every engine iteration asks `Scheduler.schedule()` what to run, runs it, and reports the sampled tokens back
with `Scheduler.update()` (vLLM's scheduler/engine split; Orca's iteration-level scheduling):

- **Running sequences first**, oldest admitted first: each decoding sequence gets its one next token, and a
  sequence still in its prefill gets its next chunk. A sequence that needs a block when none is free preempts
  the newest running sequence (its blocks go back to the pool and it waits at the head of the queue, to be
  recomputed from its prompt and the tokens it already produced; nothing it generated is lost).
- **Then waiting sequences**, in arrival order, while the batch has room (`max_seqs`) and the step's prefill
  budget (`max_prefill_tokens`) lasts: a long prompt is split into chunks over several iterations, so the
  running sequences keep decoding meanwhile (chunked prefill). A waiting sequence is admitted only when the
  blocks for its chunk are free; it never preempts a running one.
- **Prefix caching**: a full block is keyed by the hash of its tokens and of everything before it (a chain).
  A new sequence first looks its prompt's full blocks up: those found are shared (reference counted) and their
  tokens are not computed again. Writing into a block that another sequence shares copies it first
  (copy-on-write); that happens when a whole prompt was cached, as its last token is computed again for its
  logits.

A step is data (`Step`): the chunks to run (`Chunk`: which sequence, from which position, how many tokens,
whether to sample after them), the sequences preempted, and the block copies to make before the forward.
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


class BlockPool:
    """The KV cache's blocks as bookkeeping: reference counts, the free list and the prefix-cache index.

    A freed block keeps its content and its key until it is handed out again, oldest freed first: a prefix
    cached earlier stays findable while the pool has other free blocks (least recently used eviction)."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a block pool needs at least one block of at least one token "
                             f"(got {num_blocks} blocks of {block_size})")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.refs = [0] * num_blocks
        self.free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(num_blocks))
        self.key_of: dict[int, int] = {}  # block -> its prefix key (full blocks only)
        self.block_of: dict[int, int] = {}  # prefix key -> block
        self.hit_tokens = 0  # prompt tokens found in the cache
        self.query_tokens = 0  # prompt tokens looked up

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self.free)

    def allocate(self, after: int | None = None) -> int:
        """A free block: the one after `after` when it is free and holds no cached prefix (a sequence's blocks in
        runs of consecutive ids, which the paged attention reads in place), else the least recently freed."""
        if after is not None and after + 1 in self.free and after + 1 not in self.key_of:
            del self.free[after + 1]
            self.refs[after + 1] = 1
            return after + 1
        block, _ = self.free.popitem(last=False)
        key = self.key_of.pop(block, None)
        if key is not None and self.block_of.get(key) == block:
            del self.block_of[key]  # its content is about to be overwritten
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        if self.refs[block] == 0:
            del self.free[block]
        self.refs[block] += 1

    def release(self, block: int) -> None:
        assert self.refs[block] > 0, f"block {block} released more often than taken"
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free[block] = None

    def lookup(self, key: int) -> int | None:
        return self.block_of.get(key) if self.prefix_caching else None

    def register(self, block: int, key: int) -> None:
        """Block now holds the full block whose prefix key is `key`: later prompts with that prefix may share it."""
        if self.prefix_caching and key not in self.block_of:
            self.block_of[key] = block
            self.key_of[block] = key

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


def block_keys(tokens: list[int], block_size: int, start: int = 0, previous: int = 0, salt: object = None) -> list[int]:
    """Prefix keys of the full blocks of `tokens` from block `start` on (`previous`: the key of the block before)."""
    keys = []
    for b in range(start, len(tokens) // block_size):
        previous = hash((previous, salt, tuple(tokens[b * block_size:(b + 1) * block_size])))
        keys.append(previous)
    return keys


@dataclass
class Sequence:
    """One request's tokens and its place in the cache. `computed`: the tokens whose keys and values are cached."""

    id: int
    prompt: list[int]
    max_tokens: int
    arrival: float
    stop_ids: frozenset[int] = frozenset()
    salt: object = None  # part of every prefix key (a LoRA adapter's name: its blocks are not another's)
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)  # prefix keys of the full blocks registered so far
    computed: int = 0
    draft_computed: int = 0  # speculative decoding: the tokens the draft model has cached (it may lag by one)
    status: str = WAITING
    finish_reason: str | None = None
    preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache at the last admission
    looked_up: bool = False  # the prefix cache was searched for this admission
    first_token_at: float | None = None
    last_token_at: float | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)


@dataclass(frozen=True)
class Chunk:
    """Run `count` tokens of `seq` from position `start`; `sample`: they reach its end, so its next token is drawn."""

    seq: Sequence
    start: int
    count: int
    sample: bool


@dataclass(frozen=True)
class Step:
    chunks: tuple[Chunk, ...]
    preempted: tuple[Sequence, ...] = ()
    copies: tuple[tuple[int, int], ...] = ()  # (source block, destination block), copied before the forward

    @property
    def tokens(self) -> int:
        return sum(c.count for c in self.chunks)


class Scheduler:
    """Admission, chunking, preemption and finishing decisions (see the module's docstring); `clock` stamps times."""

    def __init__(self, pool: BlockPool, max_seqs: int = 128, max_prefill_tokens: int = 2048,
                 clock: Callable[[], float] | None = None, max_step_tokens: int = 0):
        if max_seqs < 1 or max_prefill_tokens < 1:
            raise ValueError(f"max_seqs ({max_seqs}) and max_prefill_tokens ({max_prefill_tokens}) must be >= 1")
        self.pool, self.max_seqs, self.max_prefill_tokens = pool, max_seqs, max_prefill_tokens
        # Decode first: a step runs every decode, then prompt chunks up to this many tokens in all (0: no such bound),
        # so a long prompt arriving never stretches the decodes' step beyond it (vLLM's max_num_batched_tokens).
        self.max_step_tokens = max_step_tokens
        self.clock = clock or (lambda: 0.0)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self._ids = itertools.count()

    # ------------------------------------------------------------------ requests in and out

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.pool.block_size)

    def add(self, prompt: list[int], max_tokens: int, stop_ids: Iterable[int] = (), salt: object = None) -> Sequence:
        """A new waiting sequence. ValueError when it could never fit the pool, even alone."""
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        self.check(len(prompt), max_tokens)
        seq = Sequence(next(self._ids), list(prompt), max_tokens, self.clock(), frozenset(stop_ids), salt)
        self.waiting.append(seq)
        return seq

    def check(self, prompt_len: int, max_tokens: int) -> None:
        """ValueError, naming what to change, when such a sequence could never fit the pool, even alone."""
        need = self.blocks_for(prompt_len + max_tokens)
        if need > self.pool.num_blocks:
            raise ValueError(f"the prompt ({prompt_len} tokens) and max_tokens ({max_tokens}) need {need} KV-cache "
                             f"blocks of {self.pool.block_size} tokens; the pool has {self.pool.num_blocks}: "
                             "ask for fewer tokens or serve with a larger --kv-cache-mb")

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence now (its blocks go back to the pool): "stop", "length", or "abort" (the client left)."""
        if seq.status == FINISHED:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status, seq.finish_reason = FINISHED, reason

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    # ------------------------------------------------------------------ one iteration

    def schedule(self) -> Step:
        chunks: list[Chunk] = []
        copies: list[tuple[int, int]] = []
        preempted: list[Sequence] = []
        budget = self.max_prefill_tokens
        if self.max_step_tokens:
            decodes = sum(1 for seq in self.running if seq.length - seq.computed == 1)
            budget = min(budget, max(self.max_step_tokens - decodes, 0 if decodes else 1))
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            left = seq.length - seq.computed
            count = 1 if left == 1 else min(left, budget)  # a decode always runs; a prefill chunk within the budget
            if count == 0:
                i += 1
                continue
            while not self._make_room(seq, count, copies):
                victim = self.running[-1]  # the newest running sequence
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != RUNNING:
                break  # it preempted itself: every sequence after it is gone too
            if count > 1:
                budget -= count
            chunks.append(Chunk(seq, seq.computed, count, seq.computed + count == seq.length))
            i += 1
        while self.waiting and len(self.running) < self.max_seqs and budget > 0:
            seq = self.waiting[0]
            if not seq.looked_up:
                self._reuse_prefix(seq)
            count = min(seq.length - seq.computed, budget)
            if not self._make_room(seq, count, copies):
                break  # wait for blocks to free: never preempt a running sequence for a waiting one
            self.waiting.popleft()
            seq.status = RUNNING
            self.running.append(seq)
            budget -= count
            chunks.append(Chunk(seq, seq.computed, count, seq.computed + count == seq.length))
        return Step(tuple(chunks), tuple(preempted), tuple(copies))

    def update(self, step: Step, sampled: dict[int, int]) -> list[Sequence]:
        """Record a step's work: `sampled[seq.id]` is the token drawn after each chunk with sample=True.
        Returns the sequences that finished (a stop token or max_tokens)."""
        now = self.clock()
        done = []
        for c in step.chunks:
            seq = c.seq
            if seq.status != RUNNING:
                continue  # finished (aborted) while the step ran
            seq.computed = c.start + c.count
            self._register_full_blocks(seq)
            if not c.sample:
                continue
            if self._emit(seq, sampled[seq.id], now):
                done.append(seq)
        return done

    def _emit(self, seq: Sequence, tok: int, now: float) -> bool:
        """Append one sampled token; True when it ended the sequence (a stop token, or max_tokens reached)."""
        seq.output.append(tok)
        if seq.first_token_at is None:
            seq.first_token_at = now
        seq.last_token_at = now
        if tok in seq.stop_ids or len(seq.output) >= seq.max_tokens:
            self.finish(seq, "stop" if tok in seq.stop_ids else "length")
            return True
        return False

    def reserve(self, seq: Sequence, count: int) -> bool:
        """Blocks for `count` tokens from seq.computed on, if the pool has them now (no preemption): speculative
        decoding writes the drafts' keys beyond the step's one token."""
        copies: list[tuple[int, int]] = []
        ok = self._make_room(seq, count, copies)
        assert not copies, "schedule() already made the block written first private"
        return ok

    def advance(self, seq: Sequence, tokens: list[int], computed: int) -> bool:
        """Speculative decoding's update: `tokens` emitted at once, `computed` tokens now cached. True when it ended."""
        now = self.clock()
        seq.computed = computed
        self._register_full_blocks(seq)
        return any(self._emit(seq, tok, now) for tok in tokens)  # stops at the token that ends it

    # ------------------------------------------------------------------ blocks

    def _reuse_prefix(self, seq: Sequence) -> None:
        """Share the cached blocks of the longest cached prefix of seq's tokens; at least its last token stays to compute."""
        seq.looked_up = True
        tokens = seq.tokens
        keys = block_keys(tokens, self.pool.block_size, salt=seq.salt)
        found = []
        for key in keys:
            block = self.pool.lookup(key)
            if block is None:
                break
            found.append(block)
        self.pool.query_tokens += len(seq.prompt)
        for block in found:
            self.pool.share(block)
        seq.blocks, seq.keys = found, keys[:len(found)]
        seq.computed = min(len(found) * self.pool.block_size, len(tokens) - 1)
        seq.draft_computed = seq.computed  # a draft model's pool shares the block ids (plait.serve.engine.core)
        seq.cached_tokens = min(seq.computed, len(seq.prompt))
        self.pool.hit_tokens += seq.cached_tokens

    def _make_room(self, seq: Sequence, count: int, copies: list[tuple[int, int]]) -> bool:
        """Blocks for seq's positions up to computed + count, the one written first made private (copy-on-write);
        False, changing nothing, when the pool cannot give them."""
        bs = self.pool.block_size
        need = self.blocks_for(seq.computed + count) - len(seq.blocks)
        first = seq.computed // bs
        cow = first < len(seq.blocks) and self.pool.refs[seq.blocks[first]] > 1
        if need + cow > self.pool.num_free:
            return False
        if cow:
            shared = seq.blocks[first]
            seq.blocks[first] = self.pool.allocate(seq.blocks[first - 1] if first else None)
            copies.append((shared, seq.blocks[first]))
            self.pool.release(shared)
            del seq.keys[first:]  # that block's key is registered under the shared one
        for _ in range(need):
            seq.blocks.append(self.pool.allocate(seq.blocks[-1] if seq.blocks else None))
        return True

    def _register_full_blocks(self, seq: Sequence) -> None:
        full = seq.computed // self.pool.block_size
        if full > len(seq.keys):
            keys = block_keys(seq.tokens[:full * self.pool.block_size], self.pool.block_size, len(seq.keys),
                              seq.keys[-1] if seq.keys else 0, seq.salt)
            for b, key in zip(range(len(seq.keys), full), keys):
                self.pool.register(seq.blocks[b], key)
            seq.keys += keys

    def _free(self, seq: Sequence) -> None:
        for block in seq.blocks:
            self.pool.release(block)
        seq.blocks, seq.keys, seq.computed, seq.looked_up = [], [], 0, False
        seq.draft_computed = 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)  # recomputed later, from its prompt and the tokens it produced
        seq.status = WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)
