"""One served model: options, the executor that holds it, the batcher in front, timeouts and backpressure.

The HTTP layer (plait.serve.entrypoints.app) only decodes requests and encodes answers; this module
decides where work runs. Each request is queued as a one-request task (plait.serve.executor.tasks: Infer,
Generate); the batcher's batch is merged into one task of the same type and handed to the
executor, whose result is split back per request. Executors share one interface, the
`Executor` protocol of plait.serve.executor.tasks (start, stop, ready, run; capacity, restarts).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from plait.models.gpt import GPT
from plait.serve.engine.build import EngineOptions, build_engine
from plait.serve.engine.core import Engine, EngineConfig, SamplingParams, TokenEvent
from plait.serve.engine.pp import PipelineGroup
from plait.serve.engine.tp import TensorParallelGroup
from plait.serve.errors import RequestError, ServeError
from plait.serve.executor.batcher import Batcher, BatchPolicy, Pending, QueueFull
from plait.serve.executor.runner import LocalExecutor, Runner
from plait.serve.executor.sequences import Completion, EngineSequences, picklable, settle
from plait.serve.executor.tasks import (
    Complete,
    Executor,
    Generate,
    GenerateOutput,
    GenRow,
    Infer,
    InferOutput,
    Result,
    RowFailed,
    Task,
)
from plait.serve.fleet.autoscale import AutoscaleConfig, Autoscaler
from plait.serve.fleet.pipeline import PipelineExecutor
from plait.serve.fleet.replicas import ReplicaPool
from plait.serve.fleet.router import ROUTES
from plait.serve.metrics import Metrics
from plait.serve.model.device import serve_device, torch_device
from plait.serve.model.load import ModelRef, ServedModel, check_name, load_model
from plait.serve.model.quantize import QUANTIZE_CHOICES
from plait.serve.model.signature import request_items


@dataclass
class ServeOptions:
    """Everything `plait serve` takes besides the model path (the CLI's flags, one to one)."""

    name: str | None = None  # served model name; default: the registry name (mlp, gpt, ...)
    host: str = "127.0.0.1"
    port: int = 8000
    replicas: int = 1
    pp: int = 1
    max_batch_size: int = 16
    max_delay_ms: float = 5.0
    max_queue: int = 256
    timeout_ms: float = 30_000.0
    token: str | None = None
    quantize: str | None = None
    max_body_mb: float = 16.0
    max_new_tokens: int = 1024  # the most tokens one /v1/generate request may ask for
    exact_batching: bool = True  # every answer bitwise the lone one (strict BLAS, padding to probed sizes: executor.runner)
    threads: int = 0  # torch threads per model process; 0: the cores left after the HTTP loop (in-process), cores / N
    max_prompt_chars: int = 65_536  # a longer /v1/generate prompt gets 413 (checked before it is tokenized)
    read_timeout_s: float = 10.0  # request head, then the whole body, must each arrive within this, else 408 / closed
    max_connections: int = 256  # open connections at most; 8 more for health and metrics (server.py), more closed at once
    trust_factory: bool = False  # build a model.factory named in an exported file (it is code)
    trust_checkpoint: bool = False  # serve a run checkpoint that has no manifest
    device: str = "auto"  # auto (cuda when available, cpu with --quantize), cpu or cuda; see plait.serve.model.device
    autoscale: str | None = None  # "MIN:MAX": replica processes follow the load (plait.serve.fleet.autoscale)
    target_ongoing: float = 2.0  # ongoing requests per replica the autoscaler aims at
    upscale_delay_s: float = 1.0
    downscale_delay_s: float = 10.0
    scale_to_zero_after_s: float = 30.0
    # Language models (plait.serve.engine.core): continuous batching over a paged KV cache, or "static" (whole batches).
    scheduler: str = "continuous"
    block_size: int = 16  # tokens per KV-cache block
    kv_cache_mb: float = 64.0  # the block pool, all layers' keys and values
    max_seqs: int = 128  # sequences in one engine step at most (vLLM's default on a CPU)
    max_prefill_tokens: int = 2048  # prompt tokens in one engine step at most (longer prompts go in chunks)
    max_step_tokens: int = 0  # tokens of one engine step, decodes first (0: no bound beyond max_prefill_tokens)
    prefix_caching: bool = True
    draft: str | None = None  # speculative decoding: a smaller model of the same vocabulary proposes tokens
    num_speculative_tokens: int = 4
    lora: tuple[str, ...] = ()  # "name=RUN_DIR_OR_ADAPTERS_FILE": LoRA adapters over the served model, by request
    tp: int = 1  # tensor-parallel generation over this many processes (plait.serve.engine.tp)
    max_model_len: int = 0  # the most tokens (prompt and output) of one OpenAI request's sequence; 0: the model's context
    route: str = "prefix"  # --replicas: which replica's engine gets a sequence (plait.serve.fleet.router.ROUTES)

    def threads_per(self, processes: int, in_process: bool = False, engine: bool = False) -> int:
        """Intra-op threads for each of `processes` model processes. In-process, one core stays with the HTTP event
        loop (oversubscribed OpenMP threads spin and stall each other), except for the LLM engine (`engine`): its
        event loop only hands tokens on (under 1 % of a core in a 32-request burst, py-spy), so it takes
        OMP_NUM_THREADS when that is set, else every core (2 threads doubled a quiet 2-core machine's capacity; on
        a machine whose cores are busy with other work they stall each other: a tiny model's request took 240 ms
        on 2 threads and 11 ms on 1 beside a test suite, so a shared machine sets OMP_NUM_THREADS or --threads)."""
        if self.threads:
            return self.threads
        cores = os.cpu_count() or 1
        if in_process and engine:
            omp = os.environ.get("OMP_NUM_THREADS", "").strip()
            return int(omp) if omp.isdigit() and int(omp) > 0 else cores
        if in_process:
            return max(1, cores - 1)
        return max(1, cores // processes)

    def validate(self) -> ServeOptions:
        value: float  # the integer options first, then the float ones
        for flag, value, low in (("--replicas", self.replicas, 1), ("--pp", self.pp, 1), ("--threads", self.threads, 0),
                                 ("--max-batch-size", self.max_batch_size, 1), ("--max-queue", self.max_queue, 1),
                                 ("--max-new-tokens", self.max_new_tokens, 1),
                                 ("--max-prompt-chars", self.max_prompt_chars, 1), ("--max-connections", self.max_connections, 1)):
            if value < low:
                raise ServeError(f"{flag} = {value} must be >= {low}")
        for flag, value in (("--max-delay-ms", self.max_delay_ms), ("--timeout-ms", self.timeout_ms),
                            ("--max-body-mb", self.max_body_mb), ("--read-timeout-s", self.read_timeout_s)):
            if not math.isfinite(value) or value < 0 or (value == 0 and flag != "--max-delay-ms"):
                raise ServeError(f"{flag} = {value} must be a finite number > 0" + (" (or 0)" if flag == "--max-delay-ms" else ""))
        if self.autoscale is not None:
            self.autoscaling.validate()
            if self.replicas != 1 or self.pp != 1:
                raise ServeError("--autoscale MIN:MAX sets the replica count itself; drop --replicas and --pp")
        if self.replicas > 1 and self.pp > 1:
            raise ServeError(f"--replicas {self.replicas} and --pp {self.pp} cannot be combined yet; "
                             "use replicas of a whole model or one pipeline")
        for flag, value, choices in (("--scheduler", self.scheduler, SCHEDULERS), ("--route", self.route, ROUTES)):
            if value not in choices:
                raise ServeError(f"{flag} {value!r} is not one of: {', '.join(choices)}")
        try:
            self.engine_config.validate()
        except ValueError as e:
            raise ServeError(str(e)) from None
        if self.num_speculative_tokens < 1:
            raise ServeError(f"--num-speculative-tokens = {self.num_speculative_tokens} must be >= 1")
        if self.draft is not None and self.scheduler != "continuous":
            raise ServeError("--draft needs the continuous-batching engine; drop --scheduler static")
        if self.draft is not None and (self.replicas > 1 or self.pp > 1 or self.autoscale is not None):
            raise ServeError("--draft needs the whole model in the server's process; drop --replicas, --pp and --autoscale")
        names = [spec.partition("=")[0] for spec in self.lora]
        for spec, name in zip(self.lora, names):
            if "=" not in spec or not name or not spec.partition("=")[2]:
                raise ServeError(f"--lora {spec!r}: give NAME=PATH (a LoRA run directory or an adapters-only export)")
            check_name(name)
        if len(set(names)) < len(names) or (self.name is not None and self.name in names):
            raise ServeError(f"--lora names must differ from each other and from the served model's: {', '.join(names)}")
        if self.lora and (self.scheduler != "continuous" or self.replicas > 1 or self.pp > 1 or self.autoscale is not None):
            raise ServeError("--lora needs the continuous-batching engine with the whole model in the server's process; "
                             "drop --scheduler static, --replicas, --pp and --autoscale")
        if self.tp < 1:
            raise ServeError(f"--tp = {self.tp} must be >= 1")
        if self.tp > 1:
            for flag, on in (("--scheduler static", self.scheduler != "continuous"), ("--replicas", self.replicas > 1),
                             ("--pp", self.pp > 1), ("--autoscale", self.autoscale is not None),
                             ("--draft", self.draft is not None), ("--lora", bool(self.lora)),
                             ("--quantize", self.quantize is not None), ("--device cuda", self.device == "cuda")):
                if on:
                    raise ServeError(f"--tp {self.tp} cannot be combined with {flag} in this version of plait; "
                                     "drop one of them")
        if self.quantize is not None and self.quantize not in QUANTIZE_CHOICES:
            raise ServeError(f"--quantize {self.quantize!r} is not one of: {', '.join(QUANTIZE_CHOICES)}")
        if self.quantize and self.pp > 1:
            raise ServeError("--quantize int8 with --pp is not supported; drop one of them")
        serve_device(self.device, self.quantize)  # --device: a known choice, not cuda with --quantize or without CUDA
        if not 0 <= self.port <= 65535:
            raise ServeError(f"--port {self.port} must be between 0 and 65535")
        if self.name is not None:
            check_name(self.name)
        if self.token is not None and (not self.token or not self.token.isprintable() or not self.token.isascii()):
            raise ServeError("the bearer token must be printable ASCII and not empty")
        return self

    @property
    def autoscaling(self) -> AutoscaleConfig:
        assert self.autoscale is not None
        lo, hi = AutoscaleConfig.parse(self.autoscale)
        return AutoscaleConfig(lo, hi, self.target_ongoing, self.upscale_delay_s, self.downscale_delay_s,
                               self.scale_to_zero_after_s)

    @property
    def engine_config(self) -> EngineConfig:
        return EngineConfig(self.block_size, self.kv_cache_mb, self.max_seqs, self.max_prefill_tokens, self.prefix_caching,
                            self.max_step_tokens)

    @property
    def policy(self) -> BatchPolicy:
        return BatchPolicy(self.max_batch_size, self.max_delay_ms, self.max_queue)


class Service:
    """The served model behind its batcher; `await start()` inside the server's event loop."""

    def __init__(self, path: str, opts: ServeOptions, served: ServedModel | None = None):
        self.opts = opts.validate()
        self.device = serve_device(opts.device, opts.quantize)  # "cpu" or "cuda": where every executor runs the model
        self.ref = ModelRef(str(path), opts.quantize, opts.trust_factory, opts.trust_checkpoint)
        self.served = served if served is not None else load_model(self.ref)
        if self.served.backend != "pytorch" and opts.pp > 1:
            raise ServeError(f"--pp {opts.pp} splits a PyTorch model's blocks; {path} is an exported file "
                             f"({self.served.backend}): serve it with --replicas instead")
        self.name = opts.name or self.served.registry_name
        if opts.max_model_len > self.served.context:
            raise ServeError(f"--max-model-len {opts.max_model_len} exceeds the model's context of "
                             f"{self.served.context} positions; give at most that")
        # What an infer body may hold, counted before it is parsed (protocol.check_items): max_batch_size rows of the inputs.
        s = self.served
        self.max_json_items = request_items(s.inputs, opts.max_batch_size, s.context if s.is_lm else None)
        self.items_hint = (f" (--max-batch-size {opts.max_batch_size} rows of the inputs of model '{self.name}': "
                           f"{', '.join(t.describe() for t in s.inputs)})")
        self.metrics = Metrics()
        self.started = time.time()  # the served model's `created` (OpenAI's /v1/models)
        self.ongoing = 0  # requests admitted and not yet answered (what the autoscaler follows)
        self._ongoing_peak = 0  # the most at once since the autoscaler last looked
        self.autoscaler: Autoscaler | None = None
        self.engine: Engine | None = None
        self.adapters: list[str] = []  # --lora names; a request's `model` picks one (adapter index = position + 1)
        self.tp_group: TensorParallelGroup | None = None
        self.pp_group: PipelineGroup | None = None  # --pp's stages, started before the executor moves this process's
        if opts.pp > 1 and opts.scheduler == "continuous" and self.served.can_generate:  # model: it keeps stage 0 alone
            self.engine, self.adapters, self.pp_group = build_engine(self.served, self.ref, opts, torch_device(self.device))
        self.executor: Executor = self._executor()
        self.batcher: Batcher | None = None
        if opts.autoscale is not None and self.served.backend == "pytorch":
            # The replicas hold the weights; the front end keeps only the shapes it describes (so that scaled
            # to zero, no copy of the model is left in memory).
            with contextlib.suppress(Exception):  # (a quantized module may not move; it then stays)
                self.served.module = self.served.module.to("meta")
        # Large request bodies are decoded (and large answers encoded) here, off the event loop. One thread: decoding
        # holds the GIL, so more threads would not decode faster, only take more turns from the loop (and memory).
        self.codec = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="plait-codec")
        # Continuous batching (plait.serve.engine.core) for a language model in this process (its stages under --pp),
        # or in each replica (remote_engine); --autoscale and --scheduler static generate whole batches through the
        # batcher (plait.serve.executor.generate).
        self.remote_engine = isinstance(self.executor, ReplicaPool) and self.executor.engine is not None
        self._grammar_engine: Engine | None = None  # --replicas: for grammars that do not pickle (_sequences_for)
        if opts.scheduler == "continuous" and self.served.can_generate and isinstance(self.executor, LocalExecutor):
            if self.engine is None:  # (--pp's is built above)
                self.engine, self.adapters, self.tp_group = build_engine(self.served, self.ref, opts,
                                                                         self.executor.runner.device)
        elif opts.draft is not None or opts.lora or opts.tp > 1:
            raise ServeError(f"--draft, --lora and --tp: model '{self.name}' does not generate text with the engine "
                             "(they need a language model with a tokenizer)")

    def _executor(self) -> Executor:
        pad_to = self.opts.max_batch_size if self.opts.exact_batching else None
        if self.opts.pp > 1 and self.pp_group is None:  # static batches through stage processes
            return PipelineExecutor(self.ref, self.served, self.opts.pp, self.opts.threads_per(self.opts.pp),
                                    device=self.device)
        if self.opts.autoscale is not None:
            cfg = self.opts.autoscaling
            return ReplicaPool(self.ref, cfg.max_replicas, pad_to, self.metrics.replica_restarts,
                               self.opts.threads_per(cfg.max_replicas), device=self.device,
                               autoscale_min=cfg.min_replicas, on_cold_start=self._cold_start)
        if self.opts.replicas > 1:  # each process loads and moves its own copy; this one's stays on the host (metadata)
            threads = self.opts.threads_per(self.opts.replicas)
            engine = EngineOptions.of(self.opts, threads).to_dict() if (
                self.opts.scheduler == "continuous" and self.served.can_generate) else None
            return ReplicaPool(self.ref, self.opts.replicas, pad_to, self.metrics.replica_restarts, threads,
                               device=self.device, engine=engine, route=self.opts.route)
        return LocalExecutor(Runner(self.served, pad_to, torch_device(self.device)))

    def _cold_start(self, index: int, split: dict) -> None:
        total = split["process_s"] + split["imports_s"] + split["load_s"]
        m = self.metrics
        m.cold_starts.inc()
        for phase, value in (("process", split["process_s"]), ("imports", split["imports_s"]),
                             ("load", split["load_s"]), ("total", total)):
            m.cold_start.labels(phase).set(value)
        print(f"replica {index}: cold start {total:.2f} s (process start {split['process_s']:.2f} s, imports "
              f"{split['imports_s']:.2f} s, weight load {split['load_s']:.2f} s)", file=sys.stderr, flush=True)

    @property
    def exactness(self) -> str:
        """' · exact: a lone request runs as N row(s)' for an in-process classifier (known once started), else ''."""
        ex = self.executor
        if not isinstance(ex, LocalExecutor) or ex.runner.pad_to is None or ex.runner.sizes is None:
            return ""
        rows = ex.runner.padded(1)
        return f" · exact answers: a lone request runs as {rows} row{'s' if rows > 1 else ''}"

    @property
    def layout(self) -> str:
        if self.opts.autoscale is not None:
            cfg = self.opts.autoscaling
            return f"{cfg.min_replicas}-{cfg.max_replicas} autoscaled replica process(es)"
        if self.opts.pp > 1:
            return f"{self.opts.pp} pipeline stages"
        return f"{self.opts.replicas} replica process(es)" if self.opts.replicas > 1 else "in-process"

    async def start(self) -> None:
        if self.engine is not None:
            self.engine.start()
            self.metrics.watch_engine(self.engine)
        await self.executor.start()
        self.batcher = Batcher(self.opts.policy, self._run_batch, self.executor.capacity,
                               on_batch=self.metrics.batch_size.observe)
        self.batcher.start()
        self.metrics.queue_depth.set_function(lambda: self.batcher.depth if self.batcher else 0)
        pool = self.executor
        if isinstance(pool, ReplicaPool) and pool.engine is not None:
            pool.watch_engines(self.metrics.registry)
        if isinstance(pool, ReplicaPool):  # replica counts (and the autoscaler) belong to a pool alone
            self.metrics.replicas.set_function(lambda: pool.live_count)
            self.metrics.replicas_desired.set(pool.target)
            if self.opts.autoscale is not None:
                self.autoscaler = Autoscaler(self.opts.autoscaling, pool, self.take_ongoing, self.metrics)
                pool.on_no_replica = self.autoscaler.wake
                self.autoscaler.start()

    def take_ongoing(self) -> int:
        """The most requests ongoing at once since the last call: a request that came and went between two of the
        autoscaler's looks still counts as traffic."""
        peak, self._ongoing_peak = max(self._ongoing_peak, self.ongoing), self.ongoing
        return peak

    async def stop(self) -> None:
        if self.batcher is not None:
            await self.batcher.stop()  # the autoscaler keeps replicas for what is queued
        if self.autoscaler is not None:
            await self.autoscaler.stop()
        await self.executor.stop()
        for engine in (self.engine, self._grammar_engine):
            if engine is not None:
                await asyncio.get_running_loop().run_in_executor(None, engine.stop)
        for close in [group.close for group in (self.tp_group, self.pp_group) if group is not None]:
            await asyncio.get_running_loop().run_in_executor(None, close)
        self.codec.shutdown(wait=False)

    async def off_loop(self, fn, *args, size: int = 0):
        """fn(*args), on the codec thread when `size` (bytes or values) is large, else right here."""
        if size < OFF_LOOP_SIZE:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.codec, fn, *args)

    def ready(self) -> bool:
        return self.batcher is not None and self.executor.ready() and not self.down

    @property
    def down(self) -> bool:
        """A --tp rank or --pp stage died: nothing is answered until a restart."""
        return any(group is not None and group.down for group in (self.tp_group, self.pp_group))

    # ------------------------------------------------------------------ requests

    async def _submit(self, key, task: Task, rows: int, arrived: float, on_event=None):
        """Queue one request's task and wait for its share of the batch's answer (within --timeout-ms)."""
        assert self.batcher is not None
        try:
            item = self.batcher.submit(key, task, rows, on_event)
        except QueueFull as e:
            self.metrics.rejected.labels("queue_full").inc()
            raise RequestError(503, f"server busy: {e}; retry later") from None
        left = self.opts.timeout_ms / 1000 - (time.perf_counter() - arrived)
        self.ongoing += 1
        self._ongoing_peak = max(self._ongoing_peak, self.ongoing)
        try:
            return await asyncio.wait_for(asyncio.shield(item.future), max(left, 0.0))
        except TimeoutError:
            self.batcher.cancel(item)
            self.metrics.rejected.labels("timeout").inc()
            raise RequestError(504, f"the request did not finish within --timeout-ms {self.opts.timeout_ms:g}; "
                                    "its work was dropped") from None
        except asyncio.CancelledError:  # the client went away
            self.batcher.cancel(item)
            raise
        finally:
            self.ongoing -= 1

    async def infer(self, x: np.ndarray, arrived: float) -> dict[str, np.ndarray]:
        """Outputs for one request's input batch (rows merged with other requests' by the batcher)."""
        key = (Infer, x.dtype.str, x.shape[1:])  # only same-shaped rows stack into one tensor
        return await self._submit(key, Infer(x), x.shape[0], arrived)

    def require_generation(self) -> None:
        if not self.served.can_generate:
            s = self.served
            if s.is_lm and s.backend != "pytorch":  # an exported file: a graph of one forward, no KV cache to step
                raise RequestError(404, f"model '{self.name}' is served from an exported {s.backend} file, which runs "
                                        "one forward pass and has no KV cache to generate with; serve the run "
                                        "directory or its model.safetensors for /v1/generate (this model answers "
                                        f"/v2/models/{self.name}/infer with next-token logits)")
            raise RequestError(404, f"model '{self.name}' does not generate text (it is a {s.registry_name} "
                                    f"{s.spec.task} model); use /v2/models/{self.name}/infer")

    async def generate(self, row: GenRow, arrived: float, on_token=None, adapter: int = 0) -> list[int]:
        """New token ids for one prompt; on_token(position, token) is called as they come (streaming).

        The continuous-batching engine runs it when there is one and the request fits the model's positions (a gpt
        request that outgrows its context is generated by the static path, which recomputes the last `context`
        tokens at each step: learned positions shift)."""
        self.require_generation()
        if (adapter or self.pp_group is not None) and not self.engine_fits(len(row.prompt), row.max_new_tokens):
            raise RequestError(400, f"the prompt ({len(row.prompt)} tokens) and max_new_tokens ({row.max_new_tokens}) "
                                    f"exceed the model's context of {self.served.context} positions, which "
                                    + ("a LoRA adapter's requests must fit" if adapter else "--pp's requests must fit "
                                       "(--scheduler static generates past it)"))
        if (self.engine is not None or self.remote_engine) and self.engine_fits(len(row.prompt), row.max_new_tokens):
            params = SamplingParams(row.max_new_tokens, row.temperature, row.top_k, 1.0, row.seed)
            emit = None if on_token is None else (lambda ev: on_token(ev.index, ev.token))
            done = await self.complete(row.prompt, params, arrived, emit, adapter=adapter)
            return [ev.token for ev in done.events]
        return await self._submit((Generate,), Generate((row,)), 1, arrived, on_token)

    def adapter_index(self, model: str) -> int:
        """0 for the served model's name, i for the i-th --lora adapter; 404 naming what is served otherwise."""
        if model in (self.name, self.ref.path):  # vLLM names a model by the path it was served from
            return 0
        if model in self.adapters:
            return self.adapters.index(model) + 1
        raise RequestError(404, f"unknown model '{model[:200]}'; this server serves: {', '.join([self.name, *self.adapters])}")

    def engine_fits(self, prompt_tokens: int, max_tokens: int) -> bool:
        """Whether the engine's positions hold such a sequence (learned ones end at a gpt's context; rotary do not)."""
        limit = self.served.context if isinstance(self.served.module, GPT) else None  # Engine.max_length, here or in a replica
        return limit is None or prompt_tokens + max_tokens <= limit

    async def complete(self, prompt: list[int], params: SamplingParams, arrived: float,
                       on_event: Callable[[TokenEvent], None] | None = None,
                       stop: Callable[[list[TokenEvent]], bool] | None = None, adapter: int = 0) -> Completion:
        """One sequence through the engine, here or in a replica: its token events (on_event(event) as each comes, on
        the event loop) and why it ended. `stop(events)`, asked after each token, ends it early (a stop string:
        finish reason "stop")."""
        if self.engine is None and not self.remote_engine:
            raise RequestError(400, "this server generates with --scheduler static (or --autoscale): the OpenAI "
                                    "endpoints need the continuous-batching engine; serve the model in one process or "
                                    "with --replicas, --tp or --pp, without --scheduler static")
        finished: asyncio.Future = asyncio.get_running_loop().create_future()  # (finish reason, why)
        events: list[TokenEvent] = []
        m = self.metrics
        last = [arrived]

        def token(ev: TokenEvent) -> None:  # on the loop
            if finished.done():
                return
            now = time.perf_counter()
            (m.time_to_first_token if not events else m.inter_token_latency).observe(now - last[0])
            last[0] = now
            m.generated_tokens.inc()
            events.append(ev)
            if on_event is not None:
                on_event(ev)
            if stop is not None and stop(events):
                cancel()
                finished.set_result(("stop", ""))

        job = asyncio.ensure_future(self._sequences_for(params).run(Complete(tuple(prompt), params, adapter), token))
        job.add_done_callback(lambda job: settle(job, finished))
        cancel = job.cancel  # the engine drops the sequence, here or in its replica
        left = self.opts.timeout_ms / 1000 - (time.perf_counter() - arrived)
        self.ongoing += 1
        self._ongoing_peak = max(self._ongoing_peak, self.ongoing)
        try:
            reason, why = await asyncio.wait_for(asyncio.shield(finished), max(left, 0.0))
        except TimeoutError:
            cancel()
            m.rejected.labels("timeout").inc()
            raise RequestError(504, f"the request did not finish within --timeout-ms {self.opts.timeout_ms:g}; "
                                    "its work was dropped") from None
        except asyncio.CancelledError:  # the client went away
            cancel()
            raise
        finally:
            self.ongoing -= 1
        if reason == "error":  # a 503 once a --tp rank or --pp stage died: nothing is answered until a restart
            raise RequestError(503 if self.down else 500, f"generation failed in the engine: {why}")
        if reason == "invalid":  # the engine refused it (engine.submit's ValueError, here or in a replica)
            raise RequestError(400, why)
        if reason.startswith("failed: "):  # this request alone: the others in the batch go on
            raise RequestError(400, f"generation failed for this request's sampling parameters (temperature, top_k, "
                                    f"top_p): {reason[len('failed: '):]}")
        return Completion(events, reason, len(prompt))

    def _sequences_for(self, params: SamplingParams) -> EngineSequences | Executor:
        """Where a sequence runs: this process's engine, or a replica's (a Complete task for the pool). A grammar
        (structured output) that does not pickle cannot cross the pipe: its sequences run on an engine built here
        on first need (this process holds a copy of the weights on the host already)."""
        if self.engine is not None or params.grammar is None or picklable(params.grammar):
            return self.executor if self.engine is None else EngineSequences(self.engine)
        if self._grammar_engine is None:
            self._grammar_engine, _, _ = build_engine(self.served, self.ref, self.opts, torch_device("cpu"))
            self._grammar_engine.start()
        return EngineSequences(self._grammar_engine)

    async def _run_batch(self, batch: list[Pending]) -> None:
        task = type(batch[0].payload).merge([p.payload for p in batch])
        match task:
            case Infer() if self.autoscaler is not None:  # the batch may wait for a cold start
                result = await self._unless_all_give_up(task, batch)
            case Infer():
                result = await self.executor.run(task)
            case Generate():
                def on_event(i: int, pos: int, tok: int) -> None:
                    callback = batch[i].on_event
                    if callback is not None and not batch[i].cancelled:
                        callback(pos, tok)

                result = await self.executor.run(task, on_event, lambda i: batch[i].cancelled)
        if result is not None:
            self._answer(batch, result)

    async def _unless_all_give_up(self, task: Task, batch: list[Pending]) -> Result | None:
        """The executor's result, or None once every request of the batch timed out or went away (its answer would
        not be read, and the work must not be waited for)."""
        run = asyncio.ensure_future(self.executor.run(task))
        run.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, if nobody waits for it
        gave_up = asyncio.ensure_future(asyncio.wait([p.future for p in batch]))
        try:
            await asyncio.wait({run, gave_up}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gave_up.cancel()
        if run.done():
            return run.result()
        run.cancel()  # a batch still waiting for a replica is dropped from the pool: it never reaches the model
        return None

    @staticmethod
    def _answer(batch: list[Pending], result: Result) -> None:
        """Each request's share of the batch's result, in the batch's order."""
        match result:
            case InferOutput(outputs=out):
                start = 0
                for p in batch:
                    stop = start + p.rows
                    if not p.future.done():
                        p.future.set_result({k: v[start:stop] for k, v in out.items()})
                    start = stop
            case GenerateOutput(tokens=tokens):
                for p, t in zip(batch, tokens):
                    if p.future.done():
                        continue
                    if isinstance(t, RowFailed):  # this request alone: the others in the batch got their tokens
                        p.future.set_exception(RequestError(400, f"generation failed for this request's sampling "
                                                                 f"parameters (temperature, top_k): {t.message}"))
                    else:
                        p.future.set_result(t)


SCHEDULERS = ("continuous", "static")
OFF_LOOP_SIZE = 64 * 1024  # bodies (bytes) or outputs (values) at least this large are handled off the event loop
MIN_TEMPERATURE = 0.01  # below it (and above 0) logits / temperature can overflow float32
SURROGATE = re.compile(r"[\ud800-\udfff]")
