"""`plait bench serve`: argument parsing only (registered in plait.cli.VERB_MODULES)."""

from __future__ import annotations

import argparse
from pathlib import Path

from plait.errors import ConfigError
from plait.serve.cli import DefaultsFormatter


def cmd_bench_serve(a) -> int:
    if a.generate:
        from plait.bench.serve_generate import GenerateOptions, parse_range, run_generate  # lazily: imports torch

        if a.requests < 1 or a.rate < 0:
            raise ConfigError(f"--requests {a.requests} must be >= 1 and --rate {a.rate:g} >= 0")
        return run_generate(str(a.model), GenerateOptions(
            requests=a.requests, rate=a.rate or 8.0, out=a.out, serve_args=["--max-batch-size", str(a.max_batch_size)],
            prompt_tokens=parse_range(a.prompt_tokens, "--prompt-tokens"), new_tokens=parse_range(a.new_tokens,
                                                                                                  "--new-tokens")))
    if a.pattern == "burst":
        from plait.bench.serve_burst import BurstOptions, run_burst  # lazily: plait --help must not import torch
        from plait.serve.fleet.autoscale import AutoscaleConfig  # lazily: plait --help must not import numpy (via protocol)

        lo, hi = AutoscaleConfig.parse(a.autoscale)
        AutoscaleConfig(lo, hi).validate()
        if a.burst_s <= 0 or a.idle_s < 0:
            raise ConfigError(f"--burst-s {a.burst_s:g} must be > 0 and --idle-s {a.idle_s:g} >= 0")
        return run_burst(str(a.model), BurstOptions(clients=max(a.concurrency), burst_s=a.burst_s, idle_s=a.idle_s,
                                                    autoscale=a.autoscale, max_batch_size=a.max_batch_size,
                                                    max_delay_ms=a.max_delay_ms, out=a.out))
    from plait.bench.serve import BenchOptions, run_bench  # lazily: plait --help must not import torch or matplotlib

    opts = BenchOptions(concurrency=a.concurrency, rate=a.rate, duration_s=a.duration, max_batch_size=a.max_batch_size,
                        max_delay_ms=a.max_delay_ms, replicas=a.replicas, out=a.out, warmup_s=a.warmup)
    return run_bench(str(a.model), opts)


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 1,4,16") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, e.g. 1,4,16")
    return values


def add_parsers(sub, bench) -> None:
    """Add `serve` to `plait bench`."""
    b = bench.add_parser("serve", help="load-test plait serve on loopback: batching off/on, 1 vs 2 replicas",
                         formatter_class=DefaultsFormatter)
    b.add_argument("model", type=Path, metavar="RUN_DIR|model.safetensors", help="the model to serve and load")
    b.add_argument("--concurrency", type=_ints, default=[1, 4, 16], help="closed-loop concurrencies (default 1,4,16)")
    b.add_argument("--rate", type=float, default=0.0, help="open-loop requests per second (0: 60%% of the best "
                                                           "closed-loop throughput of batching off; --generate: 8)")
    b.add_argument("--duration", type=float, default=3.0, help="seconds per measurement")
    b.add_argument("--warmup", type=float, default=0.5, help="seconds of load before each measurement")
    b.add_argument("--max-batch-size", type=int, default=16, help="batching on: rows merged into one batch at most")
    b.add_argument("--max-delay-ms", type=float, default=5.0, help="batching on: longest wait for a batch to fill")
    b.add_argument("--replicas", type=_ints, default=[1, 2], help="replica counts to compare (default 1,2)")
    b.add_argument("--out", type=Path, help="folder for bench_serve.png and .json (default: the run dir or the "
                                            "model's folder)")
    b.add_argument("--pattern", choices=["steady", "burst"], default="steady",
                   help="burst: one --autoscale server under burst - idle - burst (max --concurrency clients); plots "
                        "replicas and p99 over time (bench_burst.png)")
    b.add_argument("--autoscale", default="0:2", metavar="MIN:MAX", help="--pattern burst: the server's --autoscale")
    b.add_argument("--burst-s", type=float, default=5.0, help="--pattern burst: seconds of each burst")
    b.add_argument("--idle-s", type=float, default=8.0, help="--pattern burst: seconds between the bursts (the server "
                                                             "scales to zero after 3 s)")
    b.add_argument("--generate", action="store_true",
                   help="a language model: streamed generation under Poisson arrivals, --scheduler static vs the "
                        "continuous-batching engine vs the engine with prefix caching; TTFT, ITL, tokens/s and the "
                        "engine's gauges (bench_generate.png)")
    b.add_argument("--requests", type=int, default=64, help="--generate: requests per configuration")
    b.add_argument("--prompt-tokens", default="8:256", metavar="LO:HI", help="--generate: prompt lengths (uniform)")
    b.add_argument("--new-tokens", default="4:128", metavar="LO:HI", help="--generate: tokens asked for (uniform)")
    b.set_defaults(fn=cmd_bench_serve)
