"""The continuous-batching engine: a small driver around the scheduler's policy and the paged cache.

    engine = Engine(model, EngineConfig(block_size=16, kv_cache_mb=64))
    handle = engine.submit(prompt_ids, SamplingParams(max_tokens=32), on_token, on_done)   # any thread
    engine.start()        # a thread that steps while there is work; or call engine.step() yourself (tests)

Each `step()` takes new requests and cancellations from its inbox, asks the scheduler (plait.serve.engine.scheduler)
what to run, copies blocks for copy-on-write, runs one forward over every scheduled token (plait.serve.engine.paged),
samples the next token of each sequence whose chunk reached its end, and reports back: `on_token(TokenEvent)`
as each token is chosen, `on_done(reason)` once ("stop", "length", "abort", or "failed: why" when sampling
failed for this sequence's parameters: it alone ends). Both are called on the engine's
thread; the server hands them to its event loop.

Sampling is each sequence's own: its seeded CPU generator draws its tokens (the logits come to the host), so
a seed gives the same tokens whatever else is in the batch, and a preempted sequence keeps what it drew.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from plait.models.gpt import GPT
from plait.models.sampling import NOT_A_DISTRIBUTION, distribution, draw, sample, sample_rows
from plait.serve.engine import kernels
from plait.serve.engine.adapters import LoRARouter
from plait.serve.engine.paged import PagedCache, bytes_per_block
from plait.serve.engine.sampling import MaskBatch, Processors, SamplingParams
from plait.serve.engine.scheduler import FINISHED, BlockPool, Scheduler, Sequence, Step
from plait.serve.engine.speculative import verify


def on_passing_thread(fn: Callable, *args, **kwargs):
    """fn(*args, **kwargs) on a thread of its own that ends when fn returns: its value, or its exception raised here.
    What builds an engine (loading the model, packing its weights) runs so, on the caller's torch thread count.

    A thread that has run a parallel torch op keeps a team of OpenMP threads for as long as it lives. With the main
    thread's team alive beside the engine thread's, libgomp manages more threads than there are CPUs and stops
    spinning between parallel regions, so each op of a step waits for its threads to wake: on 2 cores an add of
    200,000 floats 11 -> 28 us, a 100 M model's decode step of one sequence 13.3 -> 18.6 ms (the served ITL
    4-5 ms over the in-process step). A thread that ends takes its team with it."""
    threads = torch.get_num_threads()
    out: dict[str, object] = {}

    def run() -> None:
        torch.get_num_threads()  # this thread's own set-up first, then the caller's count (as Engine._loop)
        torch.set_num_threads(threads)
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the caller as it is
            out["error"] = e

    thread = threading.Thread(target=run, name="plait-load", daemon=True)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["value"]


@dataclass(frozen=True)
class EngineConfig:
    """`plait serve`'s --block-size, --kv-cache-mb, --max-seqs, --max-prefill-tokens, --no-prefix-caching and
    --max-step-tokens."""

    block_size: int = 16
    kv_cache_mb: float = 64.0
    max_seqs: int = 128
    max_prefill_tokens: int = 2048
    prefix_caching: bool = True
    max_step_tokens: int = 0  # decode-first: a step's tokens at most, decodes first, prompt chunks fill the rest

    def validate(self) -> EngineConfig:
        for flag, value in (("--block-size", self.block_size), ("--max-seqs", self.max_seqs),
                            ("--max-prefill-tokens", self.max_prefill_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} = {value} must be an integer >= 1")
        if not isinstance(self.max_step_tokens, int) or self.max_step_tokens < 0:
            raise ValueError(f"--max-step-tokens = {self.max_step_tokens} must be an integer >= 0 (0: no bound)")
        if not math.isfinite(self.kv_cache_mb) or self.kv_cache_mb <= 0:
            raise ValueError(f"--kv-cache-mb = {self.kv_cache_mb} must be a number > 0")
        return self


@dataclass(frozen=True)
class TokenEvent:
    token: int
    index: int  # its place in the output (0: the first new token)
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()
    # The first event of a request with params.prompt_logprobs: (logprob, top) of prompt tokens 1, 2, ...
    prompt: tuple[tuple[float, tuple[tuple[int, float], ...]], ...] = ()


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    on_token: Callable[[TokenEvent], None] | None
    on_done: Callable[[str], None] | None
    arrival: float
    generator: torch.Generator = field(default_factory=torch.Generator)
    adapter: int = 0  # plait.serve.engine.adapters: 0 the base model, i the i-th --lora adapter
    seq: Sequence | None = None  # the scheduler's, once the engine has taken the request from its inbox
    processors: Processors | None = None  # penalties, bias, min tokens, a grammar (plait.serve.engine.sampling)
    # params.prompt_logprobs: (logprob, top) of prompt tokens 1.. as the prefill computes them (the first event's)
    prompt_logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] = field(default_factory=list)


class Handle:
    """A submitted request: `cancel()` from any thread (its blocks free at the engine's next step)."""

    def __init__(self, engine: Engine, request: Request):
        self._engine, self.request = engine, request

    def cancel(self, reason: str = "abort") -> None:
        self._engine._inbox.put(("finish", self.request, reason))  # after its "add": the inbox is first in, first out
        self._engine._wake.set()


class Engine:
    def __init__(self, model: nn.Module, config: EngineConfig | None = None, device: torch.device | str | None = None,
                 clock: Callable[[], float] = time.perf_counter, threads: int | None = None,
                 draft: nn.Module | None = None, num_speculative: int = 4, router: LoRARouter | None = None,
                 tp: int = 1, announce: Callable[[list[int], list, list, list | None], None] | None = None,
                 blocks: int | None = None, broken: Callable[[BaseException], BaseException | None] | None = None):
        self.config = (config or EngineConfig()).validate()
        self.model = model
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        # Speculative decoding: the draft's pool has the same blocks (one block table serves both models).
        self.draft, self.num_speculative = draft, num_speculative
        self.router = router  # many LoRA adapters (plait.serve.engine.adapters): which tokens take which, per forward
        if draft is not None and num_speculative < 1:
            raise ValueError(f"--num-speculative-tokens = {num_speculative} must be >= 1")
        # Tensor parallel (plait.serve.engine.tp): this rank's shard of the cache; `announce` tells the other ranks each forward.
        self.tp, self.announce = tp, announce
        self.broken = broken  # a failed forward's error -> the group's own (a rank died), or None
        self._copies: list[tuple[int, int]] = []  # block copies the other ranks have not been told of yet
        # `blocks`: the pool's size when it was decided for every process (plait.serve.engine.pp: each stage's the same)
        num_blocks = blocks or self.pool_blocks(model, self.config, draft, tp)
        self.cache = PagedCache(model, num_blocks, self.config.block_size, self.device, tp)
        # the linears on oneDNN's packed weights from 4 rows a step (plait.serve.engine.kernels; PLAIT_KERNELS=off: not)
        self.packed = kernels.pack_linears(model) if self.device.type == "cpu" and tp == 1 else 0
        self.draft_cache = PagedCache(draft, num_blocks, self.config.block_size, self.device) if draft is not None else None
        self.proposed = 0  # draft tokens proposed, all steps
        self.accepted = 0  # of them, accepted by the target
        self.pool = BlockPool(num_blocks, self.config.block_size, self.config.prefix_caching)
        self.scheduler = Scheduler(self.pool, self.config.max_seqs, self.config.max_prefill_tokens, clock,
                                   self.config.max_step_tokens)
        # Learned absolute positions (gpt) end at the context; rotary ones (llama) do not.
        self.max_length: int | None = model.context if isinstance(model, GPT) else None
        self.vocab = int(model.vocab_size)  # the logits' width (a processor's masks and counts)
        self.clock = clock
        self.threads = threads
        self.requests: dict[int, Request] = {}
        self.steps = 0
        self.step_tokens = 0  # tokens run through the model, all steps
        self.generated = 0  # tokens sampled, all steps
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # the last step's failure (its requests ended with "error")
        self.failures = 0  # steps that failed since start

    @staticmethod
    def pool_blocks(model: nn.Module, config: EngineConfig, draft: nn.Module | None = None, tp: int = 1) -> int:
        """Blocks in --kv-cache-mb (per rank under tensor parallel); ValueError when not even one fits."""
        per_block = bytes_per_block(model, config.block_size, tp) + (
            bytes_per_block(draft, config.block_size) if draft is not None else 0)
        num_blocks = int(config.kv_cache_mb * 2**20 // per_block)
        if num_blocks < 1:
            raise ValueError(f"--kv-cache-mb {config.kv_cache_mb:g} holds no block of {config.block_size} "
                             f"tokens ({per_block / 2**20:.3f} MB each for this model); raise it")
        return num_blocks

    # ------------------------------------------------------------------ requests

    def check(self, prompt_len: int, max_tokens: int) -> None:
        """ValueError, naming what to change, when such a request could never run."""
        if self.max_length is not None and prompt_len + max_tokens > self.max_length:
            raise ValueError(f"the prompt ({prompt_len} tokens) and max_tokens ({max_tokens}) exceed the model's "
                             f"context of {self.max_length} positions")
        self.scheduler.check(prompt_len, max_tokens)

    def submit(self, prompt: list[int], params: SamplingParams, on_token: Callable[[TokenEvent], None] | None = None,
               on_done: Callable[[str], None] | None = None, adapter: int = 0) -> Handle:
        """Queue a request (from any thread); it joins the batch at the engine's next step. `adapter`: which LoRA
        adapter of the router answers it (0: the base model); its prefix-cache keys are that adapter's own."""
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        if adapter and (self.router is None or not 0 < adapter <= self.router.count):
            raise ValueError(f"no LoRA adapter {adapter} is installed")
        self.check(len(prompt), params.max_tokens)
        req = Request(list(prompt), params, on_token, on_done, self.clock(),
                      torch.Generator().manual_seed(int(params.seed)), adapter)
        if params.processed:
            req.processors = Processors(params, req.prompt, self.vocab)
        self._inbox.put(("add", req))
        self._wake.set()
        return Handle(self, req)

    def _drain_inbox(self) -> None:
        while True:
            try:
                what, *args = self._inbox.get_nowait()
            except queue.Empty:
                return
            req: Request = args[0]
            if what == "add":
                p = req.params
                # A request that wants its prompt's log-probabilities computes every prompt token: no shared prefix.
                salt = ("prompt_logprobs", id(req)) if p.prompt_logprobs is not None else req.adapter or None
                req.seq = self.scheduler.add(req.prompt, p.max_tokens, p.stop_ids, salt)
                req.seq.arrival = req.arrival
                self.requests[req.seq.id] = req
            elif req.seq is not None:
                self._finish(req.seq, args[1])

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status == FINISHED:
            return
        self.scheduler.finish(seq, reason)
        self._done(seq)

    def _done(self, seq: Sequence) -> None:
        req = self.requests.pop(seq.id, None)
        if req is not None and req.on_done is not None:
            req.on_done(seq.finish_reason or "stop")

    # ------------------------------------------------------------------ one iteration

    @torch.inference_mode()
    def step(self) -> bool:
        """One iteration; False when there was nothing to do."""
        self._drain_inbox()
        plan = self.scheduler.schedule()
        if not plan.chunks:
            return False
        for src, dst in plan.copies:
            self.cache.copy(src, dst)
            self._copies.append((src, dst))
            if self.draft_cache is not None:
                self.draft_cache.copy(src, dst)
        if self.draft is not None and self._speculate(plan):
            return True
        # grammars compute their masks while the forward runs: llguidance's in one batch, any other on its own
        procs = {c.seq.id: pr for c in plan.chunks if c.sample and (pr := self.requests[c.seq.id].processors) is not None}
        masks = MaskBatch.start(list(procs.values()))
        in_batch = {id(pr): i for i, pr in enumerate(masks.procs)} if masks is not None else {}
        for pr in procs.values():
            if id(pr) not in in_batch:
                pr.prefetch()
        logits, at = self._forward(plan)
        if self.draft is not None:
            self._draft_follow(plan)
        picks: list[tuple[Sequence, Request, int]] = []  # the sampled chunks: sequence, request, logits row
        row = 0
        for c in plan.chunks:
            row += c.count
            req = self.requests[c.seq.id]
            if req.params.prompt_logprobs is not None:
                self._prompt_logprobs(req, c, logits[at[row - c.count]:at[row - 1] + 1])
            if c.sample:
                picks.append((c.seq, req, at[row - 1]))
        sampled: dict[int, int] = {}
        events: list[tuple[Request, TokenEvent]] = []
        failed: list[tuple[Sequence, str]] = []
        for (seq, req, r), tok in zip(picks, self._draw(picks, logits, masks)):
            if isinstance(tok, str):  # this sequence's parameters: it fails alone
                failed.append((seq, tok))
                continue
            p = req.params
            if req.processors is not None:
                req.processors.accept(tok)
            sampled[seq.id] = tok
            event = TokenEvent(tok, len(seq.output))
            if p.logprobs is not None:
                event = self._with_logprobs(event, logits[r], p.logprobs)
            if p.prompt_logprobs is not None and event.index == 0:
                event = dataclasses.replace(event, prompt=tuple(req.prompt_logprobs))
            events.append((req, event))
        for seq, why in failed:
            self.scheduler.finish(seq, "failed: " + why)
        finished = self.scheduler.update(plan, sampled)
        self.steps += 1
        self.step_tokens += plan.tokens
        self.generated += len(sampled)
        for req, event in events:
            if req.on_token is not None:
                req.on_token(event)
        for seq in [s for s, _ in failed] + finished:
            self._done(seq)
        return True

    def _draw(self, picks: list[tuple[Sequence, Request, int]], logits: torch.Tensor,
              masks: MaskBatch | None) -> list[int | str]:
        """Each picked sequence's next token, or why its sampling failed ("ValueError: ..."): its logits row through
        its processors (the grammars' masks of `masks` added to their rows at once), then one draw for the rows of
        each temperature (plait.models.sampling.sample_rows: the tokens `sample` gives row by row); a row with top-k
        or top-p draws alone."""
        rows = logits[torch.tensor([r for _, _, r in picks], dtype=torch.long)]  # a copy: ours to change
        out: list[int | str | None] = [None] * len(picks)
        batched: set[int] = set()
        if masks is not None:
            where = {id(req.processors): i for i, (_, req, _) in enumerate(picks)}
            idx = [where[id(pr)] for pr in masks.procs]
            try:
                masks.apply(rows, idx)
                batched = set(idx)
            except (RuntimeError, ValueError):  # one matcher's error: each sequence's mask alone, so it fails alone
                pass
        alone = []
        for i, (_, req, _) in enumerate(picks):
            p = req.params
            try:
                if req.processors is not None:
                    scores = req.processors(rows[i], masked=i in batched)  # masked: the row itself, changed in place
                    if scores.data_ptr() != rows[i].data_ptr():
                        rows[i] = scores
                if p.top_k is not None or p.top_p < 1.0:
                    out[i] = int(sample(rows[i], p.temperature, p.top_k, req.generator, p.top_p))
                else:
                    alone.append(i)
            except (RuntimeError, ValueError, OverflowError) as e:
                out[i] = f"{type(e).__name__}: {str(e).strip()[:200]}"
        if alone:
            together = alone if len(alone) < len(picks) else slice(None)
            toks = sample_rows(rows[together], [picks[i][1].params.temperature for i in alone],
                               [picks[i][1].generator for i in alone])
            for i, tok in zip(alone, toks):
                out[i] = tok if tok is not None else f"ValueError: {NOT_A_DISTRIBUTION}"
        return out  # type: ignore[return-value]

    def _forward(self, plan: Step) -> tuple[torch.Tensor, dict[int, int]]:
        """The logits of the step's tokens that are read, and which logits row each token's are: a chunk's last token
        when it samples, every token of a request that wants its prompt's log-probabilities."""
        ids = [t for c in plan.chunks for t in c.seq.tokens[c.start:c.start + c.count]]
        rows: list[int] = []
        end = 0
        for c in plan.chunks:
            end += c.count
            if self.requests[c.seq.id].params.prompt_logprobs is not None:
                rows += range(end - c.count, end)
            elif c.sample:
                rows.append(end - 1)
        view = self.cache.step([(c.seq.blocks, c.start, c.count) for c in plan.chunks], rows)
        return self._target(ids, view, [(c.seq, c.count) for c in plan.chunks]), {r: i for i, r in enumerate(rows)}

    def _target(self, ids: list[int], view, counts: list[tuple[Sequence, int]]) -> torch.Tensor:
        """The served model over the packed tokens, each sequence's tokens through its own adapter; (T, vocab)."""
        if self.router is not None:
            groups: dict[int, list[int]] = {}
            row = 0
            for seq, count in counts:
                adapter = self.requests[seq.id].adapter
                if adapter:
                    groups.setdefault(adapter, []).extend(range(row, row + count))
                row += count
            self.router.groups = {a: torch.tensor(rows, device=self.device) for a, rows in groups.items()}
            self.router.tokens = row
            if view.row_list is not None:  # the head sees the selected rows only: their adapters by their new places
                place = {r: i for i, r in enumerate(view.row_list)}
                selected = {a: [place[r] for r in rows if r in place] for a, rows in groups.items()}
                self.router.selected = {a: torch.tensor(rows, device=self.device) for a, rows in selected.items() if rows}
        if self.announce is not None:
            self.announce(ids, view.chunks, self._copies, view.row_list)
            self._copies = []
        try:
            with kernels.packed_forward() if self.packed else contextlib.nullcontext():
                logits = self.model(torch.tensor([ids], device=self.device), cache=view)
        except RuntimeError as e:  # under --tp a rank's death surfaces in a collective: the group names it
            why = self.broken(e) if self.broken is not None else None
            if why is None:
                raise
            raise why from None
        finally:
            if self.router is not None:
                self.router.groups, self.router.selected = {}, {}
        return logits[0].float().cpu()

    # ------------------------------------------------------------------ speculative decoding

    def _draft_forward(self, rows: list[tuple[Sequence, list[int]]]) -> torch.Tensor:
        """The draft over each sequence's tokens from its draft_computed on (`tokens`: the sequence's, drafts
        included); the last logits of each, (len(rows), vocab). Advances draft_computed."""
        assert self.draft is not None and self.draft_cache is not None
        ids, chunks, ends = [], [], []
        for seq, tokens in rows:
            start = seq.draft_computed
            ids += tokens[start:]
            chunks.append((seq.blocks, start, len(tokens) - start))
            ends.append(len(ids) - 1)
            seq.draft_computed = len(tokens)
        logits = self.draft(torch.tensor([ids], device=self.device), cache=self.draft_cache.step(chunks, ends))
        return logits[0].float().cpu()

    def _draft_follow(self, plan: Step) -> None:
        """A plain step: the draft caches what the target just cached, so that it can propose from there."""
        rows = [(c.seq, c.seq.tokens[:c.start + c.count]) for c in plan.chunks
                if c.seq.status == "running" and c.start + c.count > c.seq.draft_computed]
        if rows:
            self._draft_forward(rows)

    def _speculate(self, plan: Step) -> bool:
        """A step of decodes only: the draft proposes up to k tokens per sequence, the target checks them all in one
        forward, and each sequence emits the accepted ones plus one (plait.serve.engine.speculative). False (nothing done)
        when the step has a prompt chunk in it or no sequence has room to draft."""
        if not all(c.count == 1 and c.sample and self.requests[c.seq.id].processors is None for c in plan.chunks):
            return False
        ks: dict[int, int] = {}
        for c in plan.chunks:
            seq = c.seq
            k = min(self.num_speculative, seq.max_tokens - len(seq.output) - 1)
            if self.max_length is not None:
                k = min(k, self.max_length - seq.length)
            ks[seq.id] = k if k > 0 and self.scheduler.reserve(seq, 1 + k) else 0
        if not any(ks.values()):
            return False
        drafts: dict[int, list[int]] = {c.seq.id: [] for c in plan.chunks}
        probs: dict[int, list[torch.Tensor | None]] = {c.seq.id: [] for c in plan.chunks}
        for i in range(max(ks.values())):
            active = [c.seq for c in plan.chunks if ks[c.seq.id] > i]
            last = self._draft_forward([(seq, seq.tokens + drafts[seq.id]) for seq in active])
            for seq, logits in zip(active, last):
                req = self.requests[seq.id]
                p = req.params
                if p.temperature <= 0:
                    d, q = int(logits.argmax()), None
                else:
                    q = distribution(logits, p.temperature, p.top_k, p.top_p)
                    d = int(draw(q, req.generator))
                drafts[seq.id].append(d)
                probs[seq.id].append(q)
        ids, chunks = [], []
        for c in plan.chunks:
            seq = c.seq
            ids += seq.tokens[seq.computed:] + drafts[seq.id]
            chunks.append((seq.blocks, seq.computed, seq.length - seq.computed + len(drafts[seq.id])))
        logits = self._target(ids, self.cache.step(chunks), [(c.seq, n) for c, (_, _, n) in zip(plan.chunks, chunks)])
        row = 0
        done = []
        events: list[tuple[Request, TokenEvent]] = []
        for c, (_, _, count) in zip(plan.chunks, chunks):
            seq = c.seq
            req = self.requests[seq.id]
            p = req.params
            rows = logits[row:row + count]
            row += count
            k = len(drafts[seq.id])
            try:
                out = verify(rows[count - k - 1:], drafts[seq.id], probs[seq.id], p.temperature, p.top_k, p.top_p,
                             req.generator)
            except (RuntimeError, ValueError, OverflowError) as e:
                self.scheduler.finish(seq, f"failed: {type(e).__name__}: {str(e).strip()[:200]}")
                done.append(seq)
                continue
            self.proposed += k
            self.accepted += len(out) - 1
            length = seq.length
            base = len(seq.output)
            for j, tok in enumerate(out):
                event = TokenEvent(tok, base + j)
                if p.logprobs is not None:
                    event = self._with_logprobs(event, rows[count - k - 1 + j], p.logprobs)
                events.append((req, event))
            seq.draft_computed = min(seq.draft_computed, length + len(out) - 1)
            if self.scheduler.advance(seq, out, length + len(out) - 1):
                done.append(seq)
            if seq.status == "finished":
                events = [(r, e) for r, e in events if r is not req or e.index < len(seq.output)]
        self.steps += 1
        self.step_tokens += len(ids)
        self.generated += sum(1 for _ in events)
        for req, event in events:
            if req.on_token is not None:
                req.on_token(event)
        for seq in done:
            self._done(seq)
        return True

    @staticmethod
    def _prompt_logprobs(req: Request, chunk, rows: torch.Tensor) -> None:
        """The log-probability of each prompt token this chunk's logits predict (the row at position i predicts
        token i + 1), kept once: a preempted sequence's recomputed prefill does not add them again."""
        prompt, k = req.prompt, req.params.prompt_logprobs or 0
        have = len(req.prompt_logprobs)
        last = min(chunk.start + chunk.count, len(prompt) - 1)  # positions whose next token is a prompt token
        if last <= max(chunk.start, have):
            return
        logp = torch.log_softmax(rows[max(chunk.start, have) - chunk.start:last - chunk.start].float(), -1)
        targets = torch.tensor(prompt[max(chunk.start, have) + 1:last + 1])
        chosen = logp.gather(1, targets[:, None])[:, 0].tolist()
        top = torch.topk(logp, min(k, logp.shape[-1])) if k else None
        for j, lp in enumerate(chosen):
            pairs = tuple(zip(top.indices[j].tolist(), top.values[j].tolist())) if top is not None else ()
            req.prompt_logprobs.append((lp, pairs))

    @staticmethod
    def _with_logprobs(event: TokenEvent, logits: torch.Tensor, k: int) -> TokenEvent:
        logp = torch.log_softmax(logits.float(), -1)
        top = torch.topk(logp, min(k, logp.shape[-1])) if k else None
        return TokenEvent(event.token, event.index, float(logp[event.token]),
                          tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ())

    def run(self, until: Callable[[], bool] | None = None) -> None:
        """Step until there is no work (or `until()`), on this thread (tests, benchmarks)."""
        while not (until and until()):
            if not self.step() and self.scheduler.idle and self._inbox.empty():
                return

    # ------------------------------------------------------------------ the thread

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="plait-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        if self.threads:
            # A thread's first parallel op sets its OpenMP team from the process-wide count that the last
            # set_num_threads of any thread left (the server's runner thread sets its own after this one starts):
            # get_num_threads makes that happen now, so the engine's own count is the one that stays.
            torch.get_num_threads()
            torch.set_num_threads(self.threads)
        while not self._stop:
            try:
                if not self.step():
                    self._wake.wait(0.05 if not self.scheduler.idle else 1.0)
                    self._wake.clear()
            except Exception as e:  # the model failed mid-step: every request in flight ends with it, the engine goes on
                self.error, self.failures = e, self.failures + 1
                self._fail_all()

    def _fail_all(self) -> None:
        """End every request the scheduler holds with "error", its blocks back in the pool (nothing of the failed
        step was registered: update() never ran), so the next step starts from a clean state."""
        for req in list(self.requests.values()):
            assert req.seq is not None, "requests holds the requests the scheduler has"
            self.scheduler.finish(req.seq, "error")
            self._done(req.seq)

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ------------------------------------------------------------------ state

    def stats(self) -> dict:
        s, p = self.scheduler, self.pool
        return {"running": len(s.running), "waiting": len(s.waiting), "preemptions": s.preemptions,
                "blocks_used": p.used, "blocks_free": p.num_free, "blocks": p.num_blocks,
                "block_bytes": self.cache.bytes_per_block, "prefix_hit_rate": p.hit_rate, "steps": self.steps,
                "generated": self.generated, "proposed": self.proposed, "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0}
