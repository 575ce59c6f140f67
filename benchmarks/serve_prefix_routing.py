"""Prefix-aware routing over `plait serve --replicas 2` against least-loaded routing: prefix-cache hit rate and TTFT.

    .venv/bin/python benchmarks/serve_prefix_routing.py [--systems 8] [--system-tokens 256] [--requests 192]
                                                        [--rate 6] [--kv-blocks 96] [--rounds 1] [--routes ...]

A random Llama (transformers' LlamaForCausalLM, width 256, 4 layers, a 512-token BPE vocabulary; every weight drawn at
random) is served by two replica processes, each running the continuous-batching engine with a pool of `--kv-blocks`
blocks of 16 tokens (the whole KV cache of one replica), once per routing policy (ServeOptions.route):

  least-loaded   the baseline: the replica with fewer sequences in flight (ties in turn)
  prefix         the replica whose cache holds the longest prefix of the prompt (plait.serve.fleet.router), cold
                 prompts and ties to the least loaded
  round-robin    (with --routes ...,round-robin)

The workload: `--systems` system prompts of `--system-tokens` tokens, each followed by many user suffixes of 8-48
tokens, `--requests` in all in a random order, asking 4-32 new tokens each (greedy, no stop token), sent as token ids
to /v1/completions and streamed, arriving as a Poisson process at `--rate` per second. The defaults are chosen so that
one replica's pool holds about half of the system prompts with room to run: a replica that sees every system prompt
(least-loaded) evicts them from each other, one that sees half (prefix) keeps them.

Per policy it prints the prefix-cache hit rate over both replicas (prompt tokens found in the cache / prompt tokens
looked up, the engines' own counts, the same figure as /metrics' plait_prefix_cache_hit_rate; a warm-up of two short
requests left out), the best any routing could do (every system prompt's full blocks found after its first request),
TTFT p50 / p99 (from the scheduled arrival to the first streamed token), requests/s, preemptions, and the 1-minute
load average before and after each run: the machine's other work moves TTFT, not the hit rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import tempfile
import time
from pathlib import Path

BLOCK = 16
WIDTH, LAYERS, VOCAB = 256, 4, 512


def make_model(d: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    words = ["the", "cat", "sat", "on", "mat", "and", "dog", "ran", "to", "park", "where", "bird", "sang", "in",
             "tree", "river", "boat", "green", "hill", "night", "day", "light", "rain", "sun", "wind", "cloud"]
    rng = random.Random(0)
    corpus = " ".join(rng.choice(words) + rng.choice(["", "s", "ed", "ing"]) for _ in range(20000))
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([corpus], trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["[UNK]"]))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=WIDTH * 8 // 3 // 8 * 8,
                         num_hidden_layers=LAYERS, num_attention_heads=WIDTH // 32, num_key_value_heads=WIDTH // 64,
                         max_position_embeddings=1024, eos_token_id=None, bos_token_id=None)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    model.save_pretrained(d)
    tok.save(str(d / "tokenizer.json"))
    return d


def block_bytes() -> int:
    """One KV block of this model: layers x (k, v) x tokens x kv heads x head dim x float32."""
    return LAYERS * 2 * BLOCK * (WIDTH // 64) * 32 * 4


def workload(a) -> list[tuple[float, list[int], int, int]]:
    """(arrival s, prompt token ids, new tokens, system prompt index)."""
    rng = random.Random(a.seed)
    systems = [[rng.randrange(1, VOCAB) for _ in range(a.system_tokens)] for _ in range(a.systems)]
    asks = [(k, [rng.randrange(1, VOCAB) for _ in range(rng.randint(8, 48))], rng.randint(4, 32))
            for k in range(a.systems) for _ in range(a.requests // a.systems)]
    rng.shuffle(asks)
    t, out = 0.0, []
    for k, suffix, n in asks:
        t += rng.expovariate(a.rate)
        out.append((t, systems[k] + suffix, n, k))
    return out


def best_hit_rate(work, system_tokens: int) -> float:
    """The most any routing finds: each system prompt's full blocks cached after its first request, nothing else."""
    seen, hit, total = set(), 0, 0
    for _, prompt, _, k in work:
        total += len(prompt)
        if k in seen:
            hit += system_tokens // BLOCK * BLOCK
        seen.add(k)
    return hit / total if total else 0.0


def serve(model_dir: str, route: str, kv_blocks: int, conn) -> None:
    """A child process: `plait serve --replicas 2` with this route; answers 'totals' with the engines' counts."""
    import logging

    from plait.serve.entrypoints.server import ServerThread
    from plait.serve.service import ServeOptions

    # a line per request would drown the table (a filter: uvicorn's logging config re-enables disabled loggers)
    logging.getLogger("plait.serve.access").addFilter(lambda record: False)
    opts = ServeOptions(name="llama", replicas=2, route=route, block_size=BLOCK, max_seqs=64, max_prefill_tokens=512,
                        kv_cache_mb=kv_blocks * block_bytes() / 2**20, timeout_ms=600_000, max_queue=4096)
    with ServerThread(model_dir, opts) as srv:
        conn.send(srv.url)
        while (msg := conn.recv()) != "stop":
            assert msg == "totals"
            conn.send(srv.service.executor.engine_totals())


async def one(client, url: str, start: float, arrival: float, prompt: list[int], n: int) -> float | None:
    await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
    body = {"model": "llama", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True, "ignore_eos": True}
    first = None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - (start + arrival)
    return first


async def drive(url: str, work) -> list[float | None]:
    import httpx

    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        return await asyncio.gather(*(one(client, url, start, t, p, n) for t, p, n, _ in work))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run(model_dir: Path, route: str, work, a) -> dict:
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=serve, args=(str(model_dir), route, a.kv_blocks, child))
    proc.start()  # not a daemon: it starts the replica processes itself
    try:
        url = parent.recv()
        asyncio.run(drive(url, [(0.0, [1, 2, 3], 2, -1), (0.0, [4, 5, 6], 2, -1)]))  # warm-up: no full block
        parent.send("totals")
        before, load0 = parent.recv(), os.getloadavg()[0]
        t = time.perf_counter()
        ttft = [x for x in asyncio.run(drive(url, work)) if x is not None]
        wall = time.perf_counter() - t
        parent.send("totals")
        after, load1 = parent.recv(), os.getloadavg()[0]
        parent.send("stop")
    finally:
        proc.join(120)
        if proc.is_alive():
            proc.kill()
    hit = after["hit_tokens"] - before["hit_tokens"]
    query = after["query_tokens"] - before["query_tokens"]
    return {"route": route, "hit_rate": hit / query if query else 0.0, "ttft_p50_ms": 1000 * pct(ttft, 0.5),
            "ttft_p99_ms": 1000 * pct(ttft, 0.99), "requests_per_s": len(work) / wall,
            "preemptions": after["preemptions"] - before["preemptions"], "load_before": load0, "load_after": load1}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", type=int, default=8, help="system prompts shared by the requests")
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--requests", type=int, default=192)
    p.add_argument("--rate", type=float, default=6.0, help="arrivals per second (Poisson)")
    p.add_argument("--kv-blocks", type=int, default=96, help="KV blocks of 16 tokens in each replica's pool")
    p.add_argument("--routes", default="least-loaded,prefix", help="policies, in the order run")
    p.add_argument("--rounds", type=int, default=1, help="repeat the policies, alternating their order")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    a = p.parse_args()
    work = workload(a)
    best = best_hit_rate(work, a.system_tokens)
    routes = a.routes.split(",")
    print(f"{len(work)} requests over {a.systems} system prompts of {a.system_tokens} tokens, {a.rate:g}/s; "
          f"2 replicas x {a.kv_blocks} KV blocks of {BLOCK} tokens; best possible hit rate {best:.3f}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "llama")
        for r in range(a.rounds):
            for route in (routes if r % 2 == 0 else routes[::-1]):
                row = run(model_dir, route, work, a)
                rows.append(row)
                print(f"  {route:13s} hit rate {row['hit_rate']:.3f}  TTFT p50 {row['ttft_p50_ms']:7.1f} ms  "
                      f"p99 {row['ttft_p99_ms']:7.1f} ms  {row['requests_per_s']:.2f} req/s  preemptions "
                      f"{row['preemptions']}  load {row['load_before']:.2f} -> {row['load_after']:.2f}", flush=True)
    base = [x for x in rows if x["route"] == routes[0]]
    for route in routes[1:]:
        mine = [x for x in rows if x["route"] == route]
        hr = sum(x["hit_rate"] for x in mine) / len(mine) / max(1e-9, sum(x["hit_rate"] for x in base) / len(base))
        p50 = sum(x["ttft_p50_ms"] for x in mine) / max(1e-9, sum(x["ttft_p50_ms"] for x in base))
        print(f"{route} / {routes[0]}: hit rate {hr:.2f}x, TTFT p50 {p50:.2f}x")
    if a.out is not None:
        a.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
