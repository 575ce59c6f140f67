"""`plait bench serve MODEL --generate`: load-test a language model's generation, static batches vs the engine.

Each configuration runs as its own `plait serve` process on a free loopback port (plait.bench.serve.ServerProcess);
this process sends the workload and reads every token as it streams:

  static                      --scheduler static: whole batches generated together until the longest ends
  continuous                  the engine: iteration-level scheduling over a paged KV cache, no prefix caching
  continuous + prefix cache   the engine with prefix caching, on the same workload with a shared system prompt

The workload: `--requests` prompts of `--prompt-tokens LO:HI` tokens (uniform) asking for `--new-tokens LO:HI`
tokens each (greedy; /v1/generate makes exactly that many), arriving as a Poisson process at `--rate` per second.
Per configuration: requests/s, output tokens/s, time to first token (TTFT: from the scheduled arrival, so a request
that waits counts its wait) and inter-token latency (ITL: the gaps between one request's tokens), p50 and p99; and
from the server's /metrics, polled every 0.1 s while it runs: the most sequences running and waiting at once, preemptions,
the most KV-cache blocks in use (of the pool) and the prefix-cache hit rate. Writes bench_generate.json and
bench_generate.png (TTFT and ITL distributions per configuration).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from plait.bench.serve import ServerProcess
from plait.errors import ConfigError
from plait.models.gpt import GPT
from plait.report.plots import plt, save
from plait.serve.model.load import ModelRef, load_model

WORDS = ("the cat sat on a mat and the dog ran to the park where a bird sang in a tree while children played with "
         "a red ball near an old stone wall by the river").split()
GAUGES = ("plait_sequences_running", "plait_sequences_waiting", "plait_sequences_preempted", "plait_kv_blocks_used",
          "plait_kv_blocks_free", "plait_prefix_cache_hit_rate")


@dataclass
class GenerateOptions:
    requests: int = 64
    rate: float = 8.0  # Poisson arrivals per second
    prompt_tokens: tuple[int, int] = (8, 256)
    new_tokens: tuple[int, int] = (4, 128)
    shared_fraction: float = 0.9  # the prefix-caching workload: this much of each prompt is one system prompt
    seed: int = 0
    out: Path | None = None
    serve_args: list[str] = field(default_factory=list)  # passed to every `plait serve`


@dataclass
class Row:
    config: str
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    output_tokens: int
    errors: int
    peak_running: float | None = None
    peak_waiting: float | None = None
    preempted: float | None = None
    peak_kv_blocks_used: float | None = None
    kv_blocks: float | None = None
    prefix_hit_rate: float | None = None


def parse_range(text: str, what: str) -> tuple[int, int]:
    """'LO:HI' (or one number N, as N:N) of positive integers."""
    parts = text.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, 0)
    except ValueError:
        lo = hi = 0
    if not 1 <= lo <= hi:
        raise ConfigError(f"{what} {text!r}: give LO:HI with 1 <= LO <= HI, e.g. 8:256")
    return lo, hi


def prompt_ids(tok, rng: random.Random, n: int) -> list[int]:
    """n token ids of words, as the tokenizer cuts them (whole words, then cut to n)."""
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(" " + " ".join(rng.choice(WORDS) for _ in range(16))).tolist()
    return ids[:n]


def workloads(served, opts: GenerateOptions) -> tuple[list, list]:
    """(arrival s, prompt text, new tokens) twice: independent prompts, and prompts sharing a system prompt."""
    tok = served.tokenizer
    rng = random.Random(opts.seed)
    room = served.context if isinstance(served.module, GPT) else None  # a gpt's positions end at its context
    hi_new = opts.new_tokens[1] if room is None else min(opts.new_tokens[1], room // 2)
    hi_prompt = opts.prompt_tokens[1] if room is None else min(opts.prompt_tokens[1], room - hi_new)
    if hi_prompt < opts.prompt_tokens[0] or hi_new < opts.new_tokens[0]:
        raise ConfigError(f"--prompt-tokens {opts.prompt_tokens[0]}:... and --new-tokens {opts.new_tokens[0]}:... do "
                          f"not fit this model's context of {room} tokens: ask for fewer")
    system = prompt_ids(tok, random.Random(opts.seed + 1), int(opts.shared_fraction * hi_prompt))
    mixed, shared, t = [], [], 0.0
    for _ in range(opts.requests):
        t += rng.expovariate(opts.rate)
        n, new = rng.randint(opts.prompt_tokens[0], hi_prompt), rng.randint(opts.new_tokens[0], hi_new)
        mixed.append((t, tok.decode(prompt_ids(tok, rng, n)), new))
        own = prompt_ids(tok, rng, max(1, hi_prompt - len(system)))
        shared.append((t, tok.decode(system + own), new))
    return mixed, shared


async def _one(client, url: str, t0: float, arrival: float, prompt: str, n: int) -> dict:
    await asyncio.sleep(max(0.0, t0 + arrival - time.perf_counter()))
    times: list[float] = []
    body = {"prompt": prompt, "max_new_tokens": n, "temperature": 0, "stream": True}
    try:
        async with client.stream("POST", url + "/v1/generate", json=body) as r:
            if r.status_code != 200:
                return {"sent": t0 + arrival, "times": times, "error": r.status_code}
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"index"' in line:
                    times.append(time.perf_counter())
    except Exception as e:  # a dropped connection counts as an error, not a crash of the benchmark
        return {"sent": t0 + arrival, "times": times, "error": repr(e)}
    return {"sent": t0 + arrival, "times": times, "error": None}


async def _scrape(client, url: str, seen: dict[str, list[float]]) -> None:
    """One read of the engine's gauges from /metrics into `seen` (name -> values in time order)."""
    try:
        text = (await client.get(url + "/metrics")).text
    except Exception:  # the server is busy: the next poll
        return
    for name in GAUGES:
        m = re.search(rf"(?m)^{name} ([\d.eE+-]+)$", text)
        if m:
            seen.setdefault(name, []).append(float(m.group(1)))


async def _poll(client, url: str, seen: dict[str, list[float]], stop: asyncio.Event) -> None:
    while not stop.is_set():
        await _scrape(client, url, seen)
        try:
            await asyncio.wait_for(stop.wait(), 0.1)
        except TimeoutError:
            pass


async def drive(url: str, workload) -> tuple[list[dict], dict[str, list[float]], float]:
    """Every request of the workload at its arrival time, /metrics polled meanwhile; (results, gauges, wall s)."""
    import httpx  # lazily, with the benchmark

    limits = httpx.Limits(max_connections=2048, max_keepalive_connections=2048)
    seen: dict[str, list[float]] = {}
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        stop = asyncio.Event()
        poll = asyncio.ensure_future(_poll(client, url, seen, stop))
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_one(client, url, t0, a, p, n) for a, p, n in workload))
        wall = time.perf_counter() - t0
        stop.set()
        await poll
        await _scrape(client, url, seen)  # the counters as the run left them
    return results, seen, wall


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs) * 1000, q)) if xs else float("nan")


def summarise(config: str, results: list[dict], seen: dict[str, list[float]],
              wall: float) -> tuple[Row, list[float], list[float]]:
    """The row, and the TTFT and ITL samples (seconds) for the plot."""
    ok = [r for r in results if r["error"] is None and r["times"]]
    ttft = [r["times"][0] - r["sent"] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    tokens = sum(len(r["times"]) for r in ok)
    row = Row(config, len(ok) / wall, tokens / wall, _pct(ttft, 50), _pct(ttft, 99), _pct(itl, 50), _pct(itl, 99),
              tokens, len(results) - len(ok))
    if seen:
        used, free = seen.get("plait_kv_blocks_used", [0.0]), seen.get("plait_kv_blocks_free", [0.0])
        row.peak_running = max(seen.get("plait_sequences_running", [0.0]))
        row.peak_waiting = max(seen.get("plait_sequences_waiting", [0.0]))
        row.preempted = seen.get("plait_sequences_preempted", [0.0])[-1]
        row.peak_kv_blocks_used, row.kv_blocks = max(used), used[-1] + free[-1]
        row.prefix_hit_rate = seen.get("plait_prefix_cache_hit_rate", [0.0])[-1]
    return row, ttft, itl


HEADER = (f"{'configuration':<34} {'req/s':>6} {'tok/s':>7} {'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>7} "
          f"{'run':>4} {'wait':>5} {'preempt':>7} {'KV blocks':>10} {'prefix hit':>10}")


def format_row(r: Row) -> str:
    def n(v, fmt="{:.0f}"):
        return "n/a" if v is None else fmt.format(v)

    blocks = "n/a" if r.kv_blocks is None else f"{r.peak_kv_blocks_used:.0f}/{r.kv_blocks:.0f}"
    errors = f"  ({r.errors} failed)" if r.errors else ""
    return (f"{r.config:<34} {r.requests_per_s:>6.2f} {r.output_tokens_per_s:>7.0f} {r.ttft_p50_ms:>7.0f}ms "
            f"{r.ttft_p99_ms:>5.0f}ms {r.itl_p50_ms:>6.1f}ms {r.itl_p99_ms:>5.1f}ms {n(r.peak_running):>4} "
            f"{n(r.peak_waiting):>5} {n(r.preempted):>7} {blocks:>10} {n(r.prefix_hit_rate, '{:.0%}'):>10}{errors}")


CONFIGS: tuple[tuple[str, str, list[str]], ...] = (("static", "mixed", ["--scheduler", "static"]),
           ("continuous", "mixed", ["--no-prefix-caching"]),
           ("continuous + prefix cache", "shared", []))


def run_generate(model: str, opts: GenerateOptions) -> int:
    """Measure each configuration, print the table and the comparisons, write the JSON and the plot."""
    served = load_model(ModelRef(model))
    if not served.can_generate:
        raise ConfigError(f"--generate: {model} is not a language model ({served.spec.task}); leave --generate out to "
                          "load-test its inference endpoint")
    mixed, shared = workloads(served, opts)
    print(f"plait bench serve {model} --generate: {opts.requests} requests, Poisson {opts.rate:g}/s, prompts "
          f"{opts.prompt_tokens[0]}-{opts.prompt_tokens[1]} tokens, {opts.new_tokens[0]}-{opts.new_tokens[1]} new; "
          f"{os.cpu_count()} CPUs", flush=True)
    print(f"{HEADER}\n{'-' * len(HEADER)}", flush=True)
    rows, dists = [], {}
    for name, which, args in CONFIGS:
        server = ServerProcess(model, ["--max-queue", "4096", "--timeout-ms", "600000", *args, *opts.serve_args])
        try:
            url = f"http://{server.host}:{server.port}"
            work = mixed if which == "mixed" else shared
            asyncio.run(drive(url, [(0.0, p, min(n, 4)) for _, p, n in work[:2]]))  # warm-up
            row, ttft, itl = summarise(f"{name}, {which}", *asyncio.run(drive(url, work)))
        finally:
            server.stop()
        rows.append(row)
        dists[row.config] = (ttft, itl)
        print(format_row(row), flush=True)
    static, cont, prefix = rows
    print(f"\ncontinuous / static output tokens/s: {cont.output_tokens_per_s / static.output_tokens_per_s:.2f}x; "
          f"p99 ITL {cont.itl_p99_ms:.1f} vs {static.itl_p99_ms:.1f} ms; p50 TTFT {cont.ttft_p50_ms:.0f} vs "
          f"{static.ttft_p50_ms:.0f} ms")
    out = opts.out or (Path(model) if Path(model).is_dir() else Path(model).parent)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_generate.json").write_text(json.dumps({"model": model, "options": {**asdict(opts), "out": str(out)},
                                                         "rows": [asdict(r) for r in rows]}, indent=1))
    plot(dists, out / "bench_generate.png")
    print(f"wrote {out / 'bench_generate.png'} and {out / 'bench_generate.json'}")
    return 0


def plot(dists: dict[str, tuple[list[float], list[float]]], out: Path) -> Path:
    """The distributions (empirical CDFs) of time to first token and inter-token latency per configuration."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, k, title in ((axes[0], 0, "time to first token"), (axes[1], 1, "inter-token latency")):
        for config, d in dists.items():
            xs = np.sort(np.array(d[k]) * 1000)
            if len(xs):
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=config)
        ax.set(xscale="log", xlabel="ms", ylabel="fraction of requests" if k == 0 else "fraction of gaps", title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save(fig, out)
    return out
