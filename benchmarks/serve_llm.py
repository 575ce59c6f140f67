"""LLM serving: static batches vs continuous batching vs continuous + prefix caching, and transformers' generate.

    .venv/bin/python benchmarks/serve_llm.py [--requests 200] [--rate 40] [--out DIR]

A tiny Llama-family checkpoint (transformers' LlamaForCausalLM, every weight drawn at random, a BPE tokenizer
trained here) is saved to a temporary directory and served by `plait serve` in its own process, on 127.0.0.1,
once per configuration:

  (a) --scheduler static      whole batches (--max-batch-size 16) generated together until the longest ends
  (b) continuous              the engine: iteration-level scheduling over a paged KV cache (no prefix caching)
  (c) continuous + prefix     the same with prefix caching, on a workload whose prompts share a system prompt
  (d) speculative             (b) with --draft: the target's first layer alone, 4 tokens proposed per step
  (e) transformers            LlamaForCausalLM.generate called per request, one at a time, as without a server

The workload: `--requests` prompts of 8-256 tokens asking for 4-128 new tokens (greedy; every request gets exactly
what it asks for), arriving as a Poisson process at `--rate` per second, each streamed (server-sent events) so that
the client sees every token: time to first token (TTFT) and the gaps between tokens (inter-token latency, ITL).
(a) and (b) run the mixed workload; (b) and (c) also the shared-prefix one (a 230-token system prompt, then 8-26
tokens of its own). Then the prefix check of issue 33 item 3: a 256-token prompt, then a second sharing 90 % of it,
each alone; TTFT of the second over the first (median of 5 pairs), with prefix caching on and off.

Prints a table (requests/s, output tokens/s, p50/p99 TTFT and ITL) and writes it to serve_llm.json in --out.
(d) is (b) with a draft model proposing 4 tokens per step: the target's own first layer (see make_draft); the
server's acceptance rate is read from its /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = ["the", "cat", "sat", "on", "mat", "and", "dog", "ran", "to", "park", "where", "bird", "sang", "in", "tree",
         "while", "children", "played", "with", "red", "ball", "near", "old", "stone", "wall", "river", "boat",
         "green", "hill", "slow", "fast", "night", "day", "light", "dark", "rain", "sun", "wind", "snow", "cloud"]


def make_model(d: Path, width: int, layers: int) -> tuple[Path, object]:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    rng = random.Random(0)
    corpus = " ".join(rng.choice(WORDS) + rng.choice(["", "s", "ed", "ing", "er"]) for _ in range(20000))
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([corpus], trainers.BpeTrainer(vocab_size=512, special_tokens=["[UNK]"]))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=width, intermediate_size=width * 8 // 3 // 8 * 8,
                         num_hidden_layers=layers, num_attention_heads=width // 32, num_key_value_heads=width // 64,
                         max_position_embeddings=1024, eos_token_id=None, bos_token_id=None)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    model.save_pretrained(d)
    tok.save(str(d / "tokenizer.json"))
    return d, model


def make_draft(d: Path, model, target_dir: Path) -> Path:
    """The target's first layer alone (its embeddings, norm and head shared): a quarter-depth draft. A draft of its
    own random weights would agree with a random target at chance (1 in 512 tokens) and measure only overhead; a
    truncated one shares the target's residual stream, so it agrees often, as a trained draft does."""
    import copy

    from transformers import LlamaForCausalLM

    config = copy.deepcopy(model.config)
    config.num_hidden_layers = 1
    draft = LlamaForCausalLM(config).eval()
    missing, _ = draft.load_state_dict(model.state_dict(), strict=False)
    assert not missing, missing
    draft.save_pretrained(d)
    (d / "tokenizer.json").write_bytes((target_dir / "tokenizer.json").read_bytes())
    return d


def prompt_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def mixed_workload(n: int, rate: float, seed: int = 1) -> list[tuple[float, str, int]]:
    """(arrival s, prompt, new tokens): 8-256 words (about as many tokens), 4-128 new tokens, Poisson arrivals."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append((t, prompt_text(rng, rng.randint(8, 256)), rng.randint(4, 128)))
    return out


def shared_workload(n: int, rate: float, seed: int = 2) -> list[tuple[float, str, int]]:
    rng = random.Random(seed)
    system = prompt_text(random.Random(99), 230)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append((t, system + " " + prompt_text(rng, rng.randint(8, 26)), rng.randint(4, 128)))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model_dir: Path, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
        self.proc = subprocess.Popen([sys.executable, "-m", "plait", "serve", str(model_dir), "--port", str(self.port),
                                      "--max-new-tokens", "256", "--timeout-ms", "600000", *flags],
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)

    def __enter__(self):
        import httpx

        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/v2/health/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"plait serve exited with {self.proc.returncode}")
            time.sleep(0.2)
        raise RuntimeError("plait serve did not become ready in 120 s")

    def __exit__(self, *exc):
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(30)


async def one(client, url: str, start: float, arrival: float, prompt: str, n: int) -> dict:
    await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
    sent = time.perf_counter()
    times = []
    body = {"prompt": prompt, "max_new_tokens": n, "temperature": 0, "stream": True}
    async with client.stream("POST", url + "/v1/generate", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and '"index"' in line:
                times.append(time.perf_counter())
    return {"sent": sent, "times": times, "tokens": len(times)}


async def drive(url: str, workload) -> list[dict]:
    import httpx

    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        return await asyncio.gather(*(one(client, url, start, a, p, n) for a, p, n in workload))


def summarise(name: str, results: list[dict], wall: float) -> dict:
    ttft = sorted(r["times"][0] - r["sent"] for r in results if r["times"])
    itl = sorted(b - a for r in results for a, b in zip(r["times"], r["times"][1:]))
    tokens = sum(r["tokens"] for r in results)

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    return {"config": name, "requests_per_s": len(results) / wall, "output_tokens_per_s": tokens / wall,
            "ttft_p50_ms": 1000 * pct(ttft, 0.5), "ttft_p99_ms": 1000 * pct(ttft, 0.99),
            "itl_p50_ms": 1000 * pct(itl, 0.5), "itl_p99_ms": 1000 * pct(itl, 0.99), "wall_s": wall,
            "output_tokens": tokens}


def serve_run(model_dir: Path, name: str, workload, *flags: str) -> dict:
    with Server(model_dir, *flags) as srv:
        asyncio.run(drive(srv.url, workload[:4]))  # warm-up
        t = time.perf_counter()
        results = asyncio.run(drive(srv.url, workload))
        row = summarise(name, results, time.perf_counter() - t)
        import httpx

        m = re.search(r"(?m)^plait_speculative_acceptance_rate ([\d.eE+-]+)$", httpx.get(srv.url + "/metrics").text)
        row["acceptance_rate"] = float(m.group(1)) if m and "--draft" in flags else None
    extra = f", draft tokens accepted {row['acceptance_rate']:.0%}" if row["acceptance_rate"] is not None else ""
    print(f"  {name}: {row['output_tokens_per_s']:.0f} tok/s, TTFT p50 {row['ttft_p50_ms']:.0f} ms, "
          f"ITL p99 {row['itl_p99_ms']:.1f} ms{extra}", flush=True)
    return row


def prefix_ttft(model_dir: Path, *flags: str, pairs: int = 5) -> float:
    """Median over pairs of TTFT(second) / TTFT(first): a 256-word prompt, then one sharing its first 90 %."""
    rng = random.Random(5)
    ratios = []
    with Server(model_dir, *flags) as srv:
        asyncio.run(drive(srv.url, [(0.0, prompt_text(rng, 50), 2)]))
        for _ in range(pairs):
            first = prompt_text(rng, 256)
            second = " ".join(first.split()[:230] + prompt_text(rng, 26).split())
            a = asyncio.run(drive(srv.url, [(0.0, first, 1)]))[0]
            b = asyncio.run(drive(srv.url, [(0.0, second, 1)]))[0]
            ratios.append((b["times"][0] - b["sent"]) / (a["times"][0] - a["sent"]))
    return statistics.median(ratios)


def transformers_run(model, tok_path: Path, workload) -> dict:
    """generate() per request, one at a time, in arrival order (a request waits for the one before)."""
    import torch
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    start = time.perf_counter()
    results = []
    for arrival, prompt, n in workload:
        now = time.perf_counter() - start
        if now < arrival:
            time.sleep(arrival - now)
        sent = start + arrival
        ids = torch.tensor([tok.encode(prompt).ids])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        done = time.perf_counter()
        results.append({"sent": sent, "times": [done] * (out.shape[1] - ids.shape[1]), "tokens": out.shape[1] - ids.shape[1]})
    row = summarise("(e) transformers generate, per request", results, time.perf_counter() - start)
    row.update(ttft_p50_ms=float("nan"), ttft_p99_ms=float("nan"), itl_p50_ms=float("nan"), itl_p99_ms=float("nan"))
    print(f"  {row['config']}: {row['output_tokens_per_s']:.0f} tok/s", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rate", type=float, default=40.0, help="Poisson arrivals per second")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="every server's --threads (0: its default: every core for "
                    "the engine, cores - 1 for static batches)")
    ap.add_argument("--max-seqs", type=int, default=64, help="the engine's --max-seqs for (b)-(d)")
    ap.add_argument("--max-prefill-tokens", type=int, default=512, help="the engine's --max-prefill-tokens for (b)-(d)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, hf_model = make_model(Path(tmp) / "tiny-llama", a.width, a.layers)
        mixed, shared = mixed_workload(a.requests, a.rate), shared_workload(a.requests, a.rate)
        draft_dir = make_draft(Path(tmp) / "draft", hf_model, model_dir)
        engine = ["--max-seqs", str(a.max_seqs), "--max-prefill-tokens", str(a.max_prefill_tokens), "--threads",
                  str(a.threads)]
        rows = [serve_run(model_dir, "(a) static batches, mixed", mixed, "--scheduler", "static", "--threads",
                          str(a.threads)),
                serve_run(model_dir, "(b) continuous, mixed", mixed, "--no-prefix-caching", *engine),
                serve_run(model_dir, "(b) continuous, shared prefix", shared, "--no-prefix-caching", *engine),
                serve_run(model_dir, "(c) continuous + prefix caching, shared prefix", shared, *engine),
                serve_run(model_dir, "(d) continuous + speculative (1-layer draft), mixed", mixed, "--no-prefix-caching",
                          *engine, "--draft", str(draft_dir), "--num-speculative-tokens", "4")]
        if not a.skip_transformers:
            rows.append(transformers_run(hf_model, model_dir / "tokenizer.json", mixed))
        threads = ["--threads", str(a.threads)]
        on, off = prefix_ttft(model_dir, *threads), prefix_ttft(model_dir, "--no-prefix-caching", *threads)
    print(f"\n{a.requests} requests, Poisson {a.rate:g}/s, Llama width {a.width} x {a.layers} layers, server --threads "
          f"{a.threads} (0: each server's default), load average "
          f"{os.getloadavg()[0]:.2f}\n")
    print("| configuration | requests/s | output tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['config']} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.0f} | {r['ttft_p50_ms']:.0f} | "
              f"{r['ttft_p99_ms']:.0f} | {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} |")
    speedup = rows[1]["output_tokens_per_s"] / rows[0]["output_tokens_per_s"]
    print(f"\n(b) / (a) output tokens/s: {speedup:.2f}x (target >= 2); p99 ITL (b) {rows[1]['itl_p99_ms']:.1f} ms vs "
          f"(a) {rows[0]['itl_p99_ms']:.1f} ms")
    spec = rows[4]
    print(f"(d) / (b) output tokens/s: {spec['output_tokens_per_s'] / rows[1]['output_tokens_per_s']:.2f}x with "
          f"{spec['acceptance_rate']:.0%} of drafted tokens accepted")
    print(f"TTFT of a 90 %-shared second prompt / the first: {on:.2f} with prefix caching (target <= 0.3), "
          f"{off:.2f} without")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "serve_llm.json").write_text(json.dumps({"rows": rows, "speedup_b_over_a": speedup,
                                                       "prefix_ttft_ratio": on, "prefix_ttft_ratio_off": off,
                                                       "load_average": os.getloadavg()}, indent=1))


if __name__ == "__main__":
    main()
