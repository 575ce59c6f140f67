"""`plait bench serve`: argument parsing only (registered in plait.cli.VERB_MODULES)."""

from __future__ import annotations

import argparse
from pathlib import Path

from plait.serve.cli import DefaultsFormatter


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
    b.set_defaults(fn="plait.bench.commands:cmd_bench_serve")
