"""Decode first: what `plait serve --max-step-tokens N` does to the inter-token latency of running streams while long
prompts keep arriving, against the default (prompt chunks of --max-prefill-tokens beside the decodes).

    python benchmarks/serve_decode_first.py [--budgets 0,128,64] [--seconds 12] [--streams 8] [--prompt 1536]

The engine of `plait serve` (plait.serve.engine.core.Engine, no HTTP) on a random plait Llama of about 10 M
parameters: `--streams` sequences decode all the time (no stop token), and a `--prompt`-token request (one new token)
arrives every `--every` seconds. Per budget (0: no step bound, the baseline) it prints the decoders' inter-token
latency p50 / p99 / max, the long prompts' time to first token p50, and tokens/s, with the load average beside it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch

from plait.models.llama import Llama
from plait.serve.engine.core import Engine, EngineConfig, SamplingParams


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run(model: Llama, budget: int, a) -> dict:
    cfg = EngineConfig(block_size=16, kv_cache_mb=256, max_seqs=64, max_prefill_tokens=512, max_step_tokens=budget)
    engine = Engine(model, cfg, threads=a.threads)
    gaps: list[float] = []
    ttfts: list[float] = []
    last: dict[int, float] = {}
    lock = threading.Lock()
    g = torch.Generator().manual_seed(0)

    def stream(i: int):
        def on_token(ev):
            now = time.perf_counter()
            with lock:
                if i in last and ev.index > 2:  # past the stream's own prefill
                    gaps.append(now - last[i])
                last[i] = now
        return on_token

    for i in range(a.streams):
        prompt = torch.randint(0, model.vocab_size, (32,), generator=g).tolist()
        engine.submit(prompt, SamplingParams(max_tokens=2000, temperature=0), stream(i))
    engine.start()
    start = time.perf_counter()
    while time.perf_counter() - start < a.seconds:
        sent = time.perf_counter()
        done = threading.Event()
        prompt = torch.randint(0, model.vocab_size, (a.prompt,), generator=g).tolist()

        def first(ev, sent=sent, done=done):
            ttfts.append(time.perf_counter() - sent)
            done.set()

        engine.submit(prompt, SamplingParams(max_tokens=1, temperature=0), first)
        time.sleep(a.every)
    generated, seconds = engine.generated, time.perf_counter() - start
    engine.stop()
    return {"budget": budget, "itl_p50": pct(gaps, 0.5), "itl_p99": pct(gaps, 0.99), "itl_max": max(gaps),
            "ttft_p50": statistics.median(ttfts) if ttfts else float("nan"), "tokens_s": generated / seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="0,128,64", help="--max-step-tokens values (0: the baseline)")
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1536, help="tokens of each long prompt")
    ap.add_argument("--every", type=float, default=1.0, help="seconds between long prompts")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    a = ap.parse_args()
    torch.manual_seed(0)
    model = Llama(vocab_size=8192, context=4096, width=256, heads=4, layers=4, kv_heads=2, hidden=704).eval()
    params = sum(p.numel() for p in model.parameters())
    print(f"random Llama, {params / 1e6:.1f} M parameters; {a.streams} decoding streams, a {a.prompt}-token prompt "
          f"every {a.every:g} s, {a.seconds:g} s per budget; load average before: {os.getloadavg()[0]:.2f}")
    print(f"{'--max-step-tokens':>18} {'ITL p50 ms':>11} {'ITL p99 ms':>11} {'ITL max ms':>11} {'long TTFT p50 ms':>17} "
          f"{'tokens/s':>9}")
    for budget in (int(b) for b in a.budgets.split(",")):
        r = run(model, budget, a)
        print(f"{budget or 'off':>18} {r['itl_p50'] * 1e3:>11.1f} {r['itl_p99'] * 1e3:>11.1f} {r['itl_max'] * 1e3:>11.1f} "
              f"{r['ttft_p50'] * 1e3:>17.1f} {r['tokens_s']:>9.1f}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
