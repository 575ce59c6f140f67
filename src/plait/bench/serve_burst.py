"""`plait bench serve RUN_DIR --pattern burst`: an autoscaled server under burst - idle - burst load.

One `plait serve --autoscale MIN:MAX` process (plait.bench.serve.ServerProcess); `clients` closed-loop
clients send during each burst, nobody during the idle phase (long enough for scale to zero).
Every SAMPLE_S the load generator reads /metrics (plait_replicas, plait_replicas_desired). Every
request is accounted for: answered (200), failed (another status) or lost (no answer at all), so
"nothing is lost" is a number. Prints a per-second timeline, writes bench_burst.png (replicas and
desired count over time above p99 latency per second, bursts shaded) and bench_burst.json.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from plait.bench.serve import Conn, ServerProcess, _request, request_body
from plait.report.plots import plt, save
from plait.serve.model.load import ModelRef, load_model

SAMPLE_S = 0.25


@dataclass
class BurstOptions:
    clients: int = 16
    burst_s: float = 5.0
    idle_s: float = 8.0
    autoscale: str = "0:2"
    target_ongoing: float = 2.0
    upscale_delay_s: float = 0.5
    downscale_delay_s: float = 2.0
    scale_to_zero_after_s: float = 3.0
    max_batch_size: int = 16
    max_delay_ms: float = 5.0
    out: Path | None = None

    @property
    def phases(self) -> list[tuple[str, float]]:
        return [("burst", self.burst_s), ("idle", self.idle_s), ("burst", self.burst_s)]

    def server_args(self) -> list[str]:
        return ["--autoscale", self.autoscale, "--target-ongoing", str(self.target_ongoing),
                "--upscale-delay-s", str(self.upscale_delay_s), "--downscale-delay-s", str(self.downscale_delay_s),
                "--scale-to-zero-after-s", str(self.scale_to_zero_after_s), "--max-batch-size", str(self.max_batch_size),
                "--max-delay-ms", str(self.max_delay_ms), "--timeout-ms", "120000", "--max-queue", "4096"]


@dataclass
class BurstResult:
    phases: list[tuple[str, float, float]]  # (name, start, end) seconds from the start
    requests: list[tuple[float, float, int]] = field(default_factory=list)  # (sent, done, status; 0: no answer)
    samples: list[tuple[float, float, float]] = field(default_factory=list)  # (t, replicas, desired)
    cold_start: dict = field(default_factory=dict)  # the last one's split, from /metrics
    cold_starts: int = 0

    @property
    def answered(self) -> int:
        return sum(1 for r in self.requests if r[2] == 200)

    @property
    def lost(self) -> int:
        """Requests sent and never answered with 200."""
        return len(self.requests) - self.answered

    def timeline(self, bin_s: float = 1.0) -> list[dict]:
        """Per bin: replicas (max), desired (max), answers, p99 latency (ms) of the requests sent in it."""
        end = max([p[2] for p in self.phases] + [r[1] for r in self.requests] + [0.0])
        rows = []
        for i in range(int(np.ceil(end / bin_s))):
            lo, hi = i * bin_s, (i + 1) * bin_s
            lat = [(d - s) * 1000 for s, d, st in self.requests if lo <= s < hi and st == 200]
            smp = [(r, d) for t, r, d in self.samples if lo <= t < hi]
            burst = any(p[0] == "burst" and p[1] < hi and lo < p[2] for p in self.phases)  # a burst in the bin
            phase = "burst" if burst else next((p[0] for p in self.phases if p[1] <= lo < p[2]), "drain")
            rows.append({"t": lo, "phase": phase, "replicas": max((r for r, _ in smp), default=float("nan")),
                         "desired": max((d for _, d in smp), default=float("nan")), "answers": len(lat),
                         "p99_ms": float(np.percentile(lat, 99)) if lat else float("nan")})
        return rows


METRIC = re.compile(rb"^(plait_replicas|plait_replicas_desired|plait_cold_starts_total|plait_cold_start_seconds"
                    rb'(?:\{phase="(\w+)"\})?) (\S+)$', re.M)


async def read_metrics(host: str, port: int) -> dict[str, float]:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(f"GET /metrics HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        data = await reader.read()
    finally:
        writer.close()
    return {m.group(1).decode(): float(m.group(3)) for m in METRIC.finditer(data)}


async def burst_load(host: str, port: int, path: str, body: bytes, clients: int,
                     phases: list[tuple[str, float]]) -> BurstResult:
    """Drive the phases one after the other (a burst ends when its clients' last answers are in, so an idle phase
    is idle for its whole length however long a cold start held the burst); sample the replica counts throughout;
    every request sent is recorded with its outcome."""
    head = _request(path, body, host)
    t0 = time.perf_counter()
    result = BurstResult([])
    stop = asyncio.Event()

    def now() -> float:
        return time.perf_counter() - t0

    async def sample() -> None:
        while not stop.is_set():
            m = await read_metrics(host, port)
            result.samples.append((now(), m.get("plait_replicas", float("nan")),
                                   m.get("plait_replicas_desired", float("nan"))))
            try:
                await asyncio.wait_for(stop.wait(), SAMPLE_S)
            except TimeoutError:
                pass

    async def client(end: float) -> None:
        c = None
        while now() < end:
            sent = now()
            try:
                c = c or await Conn(host, port).open()
                status = await c.post(head, body)
            except (OSError, asyncio.IncompleteReadError):
                status, c = 0, None
            result.requests.append((sent, now(), status))
        if c is not None:
            c.close()

    sampler = asyncio.ensure_future(sample())
    for name, seconds in phases:
        start = result.phases[-1][2] if result.phases else now()
        if name == "burst":
            await asyncio.gather(*(client(start + seconds) for _ in range(clients)))
        else:
            await asyncio.sleep(seconds)
        result.phases.append((name, start, now()))
    stop.set()
    await sampler
    m = await read_metrics(host, port)
    result.samples.append((now(), m.get("plait_replicas", float("nan")), m.get("plait_replicas_desired", float("nan"))))
    result.cold_starts = int(m.get("plait_cold_starts_total", 0))
    result.cold_start = {p: m[f'plait_cold_start_seconds{{phase="{p}"}}'] for p in ("process", "imports", "load", "total")
                         if f'plait_cold_start_seconds{{phase="{p}"}}' in m}
    return result


def plot_burst(result: BurstResult, out: Path, title: str = "") -> Path:
    fig, (a, b) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    ts = [s[0] for s in result.samples]
    a.step(ts, [s[1] for s in result.samples], where="post", label="replicas up")
    a.step(ts, [s[2] for s in result.samples], where="post", linestyle="--", label="desired")
    rows = result.timeline()  # seconds without answers are NaN: the line breaks there
    b.plot([r["t"] + 0.5 for r in rows], [r["p99_ms"] for r in rows], "o-", label="p99 latency (per second sent)")
    for ax in (a, b):
        for name, start, end in result.phases:
            if name == "burst":
                ax.axvspan(start, end, color="tab:orange", alpha=0.12)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    a.set(ylabel="replicas", title=title or f"burst - idle - burst: {result.answered} answered, {result.lost} lost")
    b.set(yscale="log", xlabel="seconds", ylabel="p99 latency (ms)")
    save(fig, out)
    return out


def run_burst(model: str, opts: BurstOptions) -> int:
    served = load_model(ModelRef(model))
    body = request_body(served)
    print(f"plait bench serve {model} --pattern burst: --autoscale {opts.autoscale}, {opts.clients} clients, "
          f"phases {' / '.join(f'{n} {s:g}s' for n, s in opts.phases)}", flush=True)
    server = ServerProcess(model, opts.server_args())
    try:
        result = asyncio.run(burst_load(server.host, server.port, f"/v2/models/{server.name}/infer", body, opts.clients,
                                        opts.phases))
    finally:
        server.stop()
    print(f"{'t s':>5} {'phase':<6} {'replicas':>8} {'desired':>8} {'answers':>8} {'p99 ms':>9}")
    for r in result.timeline():
        print(f"{r['t']:>5.0f} {r['phase']:<6} {r['replicas']:>8.0f} {r['desired']:>8.0f} {r['answers']:>8} "
              f"{r['p99_ms']:>9.1f}")
    split = result.cold_start
    print(f"requests: {len(result.requests)} sent, {result.answered} answered, {result.lost} lost; "
          f"{result.cold_starts} cold start(s), the last "
          + (f"{split['total']:.2f} s (process start {split['process']:.2f} s, imports {split['imports']:.2f} s, "
             f"weight load {split['load']:.2f} s)" if split else "-"))
    out = opts.out or (Path(model) if Path(model).is_dir() else Path(model).parent)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_burst.json").write_text(json.dumps({
        "model": model, "options": {**asdict(opts), "out": str(out)}, "sent": len(result.requests),
        "answered": result.answered, "lost": result.lost, "cold_starts": result.cold_starts, "cold_start": split,
        "timeline": result.timeline(), "samples": result.samples}, indent=1))
    plot_burst(result, out / "bench_burst.png")
    print(f"wrote {out / 'bench_burst.png'} and {out / 'bench_burst.json'}")
    return 0 if result.lost == 0 else 1
