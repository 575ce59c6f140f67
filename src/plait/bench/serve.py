"""`plait bench serve RUN_DIR`: load-test `plait serve` on loopback, batching off vs on and 1 vs 2 replicas.

Each configuration runs as its own `plait serve` process on a free port; this process is the
load generator: raw HTTP/1.1 keep-alive connections on asyncio (the cheapest client, so the
server is what is measured). Closed loop: C clients each send the next request when the last
is answered. Open loop: Poisson arrivals at a fixed rate, latency counted from the scheduled
send time (no coordinated omission), outstanding requests bounded. Prints the table once (a row as
each point is measured), says whether the targets are met (batching >= 3x the throughput of no
batching at concurrency 16; p99 <= max_delay + 2 x the compute time of one full batch) and what a
target not met means, and writes bench_serve.png and bench_serve.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from plait.report.plots import plt, save
from plait.serve.errors import ServeError
from plait.serve.executor.runner import Runner
from plait.serve.model.device import serve_device, torch_device
from plait.serve.model.load import ModelRef, load_model
from plait.serve.service import ServeOptions

MAX_OUTSTANDING = 512  # open loop: arrivals beyond this many unanswered requests are counted as dropped


@dataclass
class BenchOptions:
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16])
    rate: float = 0.0  # open-loop requests/s; 0: 60% of batching-off's best closed-loop throughput
    duration_s: float = 3.0
    warmup_s: float = 0.5
    max_batch_size: int = 16
    max_delay_ms: float = 5.0
    replicas: list[int] = field(default_factory=lambda: [1, 2])
    out: Path | None = None


@dataclass
class Point:
    config: str
    load: str
    concurrency: int | None
    rate: float | None
    throughput: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    errors: int
    dropped: int = 0


class Conn:
    """One HTTP/1.1 keep-alive connection that POSTs and reads Content-Length framed answers."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port

    async def open(self) -> Conn:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def post(self, head: bytes, body: bytes) -> int:
        self.writer.write(head + body)
        header = await self.reader.readuntil(b"\r\n\r\n")
        status = int(header[9:12])
        m = re.search(rb"(?im)^content-length:\s*(\d+)", header)
        if m:
            await self.reader.readexactly(int(m.group(1)))
        elif re.search(rb"(?im)^transfer-encoding:\s*chunked", header):  # e.g. Ray Serve's proxy
            while size := int((await self.reader.readline()).split(b";")[0], 16):
                await self.reader.readexactly(size + 2)
            await self.reader.readline()
        return status

    def close(self) -> None:
        self.writer.close()


def _request(path: str, body: bytes, host: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()


def _percentiles(lat: list[float]) -> tuple[float, float, float]:
    if not lat:
        return (float("nan"),) * 3
    p = np.percentile(np.array(lat) * 1000, [50, 95, 99])
    return float(p[0]), float(p[1]), float(p[2])


async def closed_loop(host: str, port: int, path: str, body: bytes, clients: int, warmup_s: float,
                      duration_s: float) -> tuple[float, list[float], int]:
    """Throughput (answers/s), latencies and errors of `clients` back-to-back senders in the measured window."""
    head = _request(path, body, host)
    conns = [await Conn(host, port).open() for _ in range(clients)]
    t0 = time.perf_counter()
    start, end = t0 + warmup_s, t0 + warmup_s + duration_s
    lat: list[float] = []
    errors = 0

    async def client(c: Conn) -> None:
        nonlocal errors
        while True:
            s = time.perf_counter()
            if s >= end:
                return
            status = await c.post(head, body)
            e = time.perf_counter()
            if start <= s and e <= end:
                if status == 200:
                    lat.append(e - s)
                else:
                    errors += 1

    await asyncio.gather(*(client(c) for c in conns))
    for c in conns:
        c.close()
    return len(lat) / duration_s, lat, errors


async def open_loop(host: str, port: int, path: str, body: bytes, rate: float, warmup_s: float,
                    duration_s: float, seed: int = 0) -> tuple[float, list[float], int, int]:
    """Poisson arrivals at `rate`/s; latency from the scheduled send time. Returns throughput, latencies, errors, drops."""
    head = _request(path, body, host)
    idle: list[Conn] = []
    rng = random.Random(seed)
    lat: list[float] = []
    errors = dropped = outstanding = 0
    t0 = time.perf_counter()
    start, end = t0 + warmup_s, t0 + warmup_s + duration_s
    tasks = set()

    async def one(scheduled: float) -> None:
        nonlocal errors, outstanding
        c = idle.pop() if idle else await Conn(host, port).open()
        status = await c.post(head, body)
        e = time.perf_counter()
        idle.append(c)
        outstanding -= 1
        if start <= scheduled < end:
            if status == 200:
                lat.append(e - scheduled)
            else:
                errors += 1

    t = t0
    while True:
        t += rng.expovariate(rate)
        if t >= end:
            break
        delay = t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if outstanding >= MAX_OUTSTANDING:
            dropped += start <= t
            continue
        outstanding += 1
        task = asyncio.ensure_future(one(t))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)
    for c in idle:
        c.close()
    return len(lat) / duration_s, lat, errors, dropped


class ServerProcess:
    """`plait serve` in a child process on a free loopback port; stopped with SIGTERM."""

    def __init__(self, model: str, args: list[str]):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "plait", "serve", model, "--port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        for line in self.proc.stdout:
            m = re.search(r"serving '([^']+)'.* at http://([\d.]+):(\d+)", line)
            if m:
                self.name, self.host, self.port = m.group(1), m.group(2), int(m.group(3))
                break
        else:
            self.stop()
            raise ServeError(f"plait serve {model} {' '.join(args)} did not start (exit code {self.proc.returncode})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def request_body(served, binary_outputs: bool = True) -> bytes:
    """One row of the model's input as a JSON infer request; binary outputs are the cheaper answer to encode."""
    x = served.example_input(1).numpy()
    spec = served.inputs[0]
    return json.dumps({"inputs": [{"name": spec.name, "shape": list(x.shape), "datatype": spec.datatype,
                                   "data": x.reshape(-1).tolist()}],
                       "parameters": {"binary_data_output": binary_outputs}}).encode()


def batch_compute_ms(served, rows: int, repeats: int = 30) -> float:
    """Median time of one forward of a full batch (padded as the server pads it), in this process."""
    import torch

    torch.set_num_threads(ServeOptions().threads_per(1, in_process=True))  # as `plait serve` runs it,
    runner = Runner(served, rows, torch_device(serve_device(ServeOptions().device)))  # on the device it picks
    x = served.example_input(rows).numpy()
    runner.infer(x)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        runner.infer(x)  # returns host numpy: on a GPU the time includes the wait for the device
        times.append(time.perf_counter() - t)
    served.module.cpu()  # the servers measured next hold their own copies; this process keeps none on the device
    return float(np.median(times) * 1000)


def run_bench(model: str, opts: BenchOptions) -> int:
    """Measure every configuration, print the table and the target checks, write the plot and JSON."""
    served = load_model(ModelRef(model))
    body = request_body(served)
    compute_ms = batch_compute_ms(served, opts.max_batch_size)
    configs = [(f"batching {'on' if on else 'off'}, {r} replica{'s' if r > 1 else ''}", on, r)
               for r in opts.replicas for on in (False, True)]
    points: list[Point] = []
    rate = opts.rate
    print(f"plait bench serve {model}: {served.registry_name} ({served.spec.task}), batching on = max {opts.max_batch_size} "
          f"rows / {opts.max_delay_ms:g} ms; {opts.duration_s:g}s per point after {opts.warmup_s:g}s warm-up; "
          f"{os.cpu_count()} CPUs; one full batch computes in {compute_ms:.2f} ms", flush=True)
    print(f"{HEADER}\n{'-' * len(HEADER)}", flush=True)  # each row is printed as soon as it is measured
    for name, on, replicas in configs:
        args = ["--replicas", str(replicas), "--max-queue", "4096"]
        args += (["--max-batch-size", str(opts.max_batch_size), "--max-delay-ms", str(opts.max_delay_ms)] if on
                 else ["--max-batch-size", "1", "--max-delay-ms", "0"])
        server = ServerProcess(model, args)
        try:
            path = f"/v2/models/{server.name}/infer"
            for c in opts.concurrency:
                tput, lat, err = asyncio.run(closed_loop(server.host, server.port, path, body, c, opts.warmup_s,
                                                         opts.duration_s))
                points.append(Point(name, f"closed c={c}", c, None, tput, *_percentiles(lat), err))
                print(_row(points[-1]), flush=True)
            if rate <= 0:
                rate = 0.6 * max(p.throughput for p in points if p.config == name)
            tput, lat, err, dropped = asyncio.run(open_loop(server.host, server.port, path, body, rate, opts.warmup_s,
                                                            opts.duration_s))
            points.append(Point(name, f"open {rate:.0f}/s", None, rate, tput, *_percentiles(lat), err, dropped))
            print(_row(points[-1]), flush=True)
        finally:
            server.stop()
    checks = target_checks(points, opts, compute_ms)
    if checks:
        print("\n" + "\n".join(checks))
    if any(not c.endswith(": met") for c in checks):
        print(MISSED)
    out = opts.out or (Path(model) if Path(model).is_dir() else Path(model).parent)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_serve.json").write_text(json.dumps({"model": model, "options": {**asdict(opts), "out": str(out)},
                                                      "batch_compute_ms": compute_ms, "checks": checks,
                                                      "points": [asdict(p) for p in points]}, indent=1))
    plot(points, out / "bench_serve.png")
    print(f"wrote {out / 'bench_serve.png'} and {out / 'bench_serve.json'}")
    return 0


HEADER = f"{'configuration':<26} {'load':<14} {'req/s':>9} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'errors':>7}"


def _row(p: Point) -> str:
    errs = f"{p.errors}" + (f"+{p.dropped}d" if p.dropped else "")
    return (f"{p.config:<26} {p.load:<14} {p.throughput:>9.1f} {p.p50_ms:>8.2f} {p.p95_ms:>8.2f} {p.p99_ms:>8.2f} "
            f"{errs:>7}")


def format_table(points: list[Point]) -> str:
    return "\n".join([HEADER, "-" * len(HEADER), *(_row(p) for p in points)])


def target_checks(points: list[Point], opts: BenchOptions, compute_ms: float) -> list[str]:
    """The issue's targets, measured at the highest concurrency with 1 replica (or the first replica count)."""
    c = max(opts.concurrency)
    r = opts.replicas[0]
    suffix = f", {r} replica{'s' if r > 1 else ''}"
    off = next((p for p in points if p.config == "batching off" + suffix and p.concurrency == c), None)
    on = next((p for p in points if p.config == "batching on" + suffix and p.concurrency == c), None)
    if off is None or on is None:
        return []
    ratio = on.throughput / off.throughput if off.throughput else float("inf")
    bound = opts.max_delay_ms + 2 * compute_ms

    def verdict(ok: bool) -> str:
        return "met" if ok else "not met on this machine"

    return [
        f"target: batching serves >= 3x the requests/s of no batching at concurrency {c}{suffix}: {ratio:.2f}x: "
        f"{verdict(ratio >= 3)}",
        f"target: p99 latency with batching at concurrency {c}{suffix} <= max_delay {opts.max_delay_ms:g} ms + "
        f"2 x batch compute {compute_ms:.2f} ms = {bound:.2f} ms: {on.p99_ms:.2f} ms: {verdict(on.p99_ms <= bound)}",
    ]


# What a target not met means, printed under the targets when one is not met.
MISSED = ("A target not met is a measurement, not an error: the server answered and the install works. Batching pays "
          "when a batch's rows compute together faster than one by one (a larger model, free cores); on a small or "
          "busy machine the load generator and the server share the CPUs. See docs/serving.md.")


def plot(points: list[Point], out: Path) -> Path:
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for config in dict.fromkeys(p.config for p in points):
        closed = [p for p in points if p.config == config and p.concurrency is not None]
        xs = [p.concurrency for p in closed]
        a.plot(xs, [p.throughput for p in closed], "o-", label=config)
        b.plot(xs, [p.p99_ms for p in closed], "o-", label=config)
    a.set(xscale="log", xlabel="concurrency (closed loop)", ylabel="requests / s", title="throughput")
    b.set(xscale="log", yscale="log", xlabel="concurrency (closed loop)", ylabel="p99 latency (ms)", title="p99 latency")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save(fig, out)
    return out
