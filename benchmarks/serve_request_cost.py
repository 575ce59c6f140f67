"""The server's CPU time per request: what `plait serve` itself spends on each request (all its threads).

    python benchmarks/serve_request_cost.py RUN_DIR [--duration 4] [--concurrency 16]

Throughput on a small shared machine moves with whatever else runs there; the CPU time the server
process is charged per answered request (user + system, from /proc, every thread: the HTTP event
loop, the codec and the model thread) moves much less, and it is the cost the faster request path
cuts. Runs `plait serve` with batching off (--max-batch-size 1) and on, each under a closed loop of
`--concurrency` clients, and prints CPU ms per request and requests/s. Compare two versions of
plait by running this with each on PYTHONPATH (docs/serving.md has the figures and commands).
"""

from __future__ import annotations

import argparse
import asyncio
import os

from plait.bench.serve import ServerProcess, closed_loop, request_body
from plait.serve.model.load import ModelRef, load_model


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(model: str, args: list[str], body: bytes, clients: int, duration_s: float) -> tuple[float, float]:
    server = ServerProcess(model, args)
    try:
        path = f"/v2/models/{server.name}/infer"
        asyncio.run(closed_loop(server.host, server.port, path, body, clients, 0.0, 1.0))  # warm up
        before = cpu_s(server.proc.pid)
        tput, lat, errors = asyncio.run(closed_loop(server.host, server.port, path, body, clients, 0.0, duration_s))
        used = cpu_s(server.proc.pid) - before
        assert errors == 0, f"{errors} errors"
        return used / max(1, len(lat)) * 1000, tput
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--duration", type=float, default=4.0)
    p.add_argument("--concurrency", type=int, default=16)
    a = p.parse_args()
    body = request_body(load_model(ModelRef(a.model)))
    for name, args in (("batching off", ["--max-batch-size", "1", "--max-delay-ms", "0"]),
                       ("batching on", ["--max-batch-size", "16", "--max-delay-ms", "5"])):
        ms, tput = measure(a.model, args + ["--max-queue", "4096"], body, a.concurrency, a.duration)
        print(f"{name:<13} c={a.concurrency}: server CPU {ms:.3f} ms per request, {tput:.0f} requests/s", flush=True)


if __name__ == "__main__":
    main()
