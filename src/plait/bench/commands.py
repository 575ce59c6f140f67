"""What `plait bench serve` does (its parser: plait.bench.cli): steady load, a burst under autoscaling, or streamed
generation. Imported when the verb runs."""

from __future__ import annotations

from plait.bench.serve import BenchOptions, run_bench
from plait.bench.serve_burst import BurstOptions, run_burst
from plait.bench.serve_generate import GenerateOptions, parse_range, run_generate
from plait.errors import ConfigError
from plait.serve.fleet.autoscale import AutoscaleConfig


def cmd_bench_serve(a) -> int:
    if a.generate:
        if a.requests < 1 or a.rate < 0:
            raise ConfigError(f"--requests {a.requests} must be >= 1 and --rate {a.rate:g} >= 0")
        return run_generate(str(a.model), GenerateOptions(
            requests=a.requests, rate=a.rate or 8.0, out=a.out, serve_args=["--max-batch-size", str(a.max_batch_size)],
            prompt_tokens=parse_range(a.prompt_tokens, "--prompt-tokens"), new_tokens=parse_range(a.new_tokens,
                                                                                                  "--new-tokens")))
    if a.pattern == "burst":
        lo, hi = AutoscaleConfig.parse(a.autoscale)
        AutoscaleConfig(lo, hi).validate()
        if a.burst_s <= 0 or a.idle_s < 0:
            raise ConfigError(f"--burst-s {a.burst_s:g} must be > 0 and --idle-s {a.idle_s:g} >= 0")
        return run_burst(str(a.model), BurstOptions(clients=max(a.concurrency), burst_s=a.burst_s, idle_s=a.idle_s,
                                                    autoscale=a.autoscale, max_batch_size=a.max_batch_size,
                                                    max_delay_ms=a.max_delay_ms, out=a.out))
    opts = BenchOptions(concurrency=a.concurrency, rate=a.rate, duration_s=a.duration, max_batch_size=a.max_batch_size,
                        max_delay_ms=a.max_delay_ms, replicas=a.replicas, out=a.out, warmup_s=a.warmup)
    return run_bench(str(a.model), opts)
