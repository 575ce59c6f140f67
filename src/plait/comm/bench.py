"""`plait bench collectives`: an nccl-tests-style sweep of collectives over message sizes and algorithms.

    rows = run_collectives(BenchOptions(ops=["allreduce"], algos=["native", "ring"], ranks=2))

For every (op, size) each algorithm's result is checked once against torch's own collective, each
algorithm gets `warmup` untimed calls, then `repeats` trials of `iters` calls are timed, the
algorithms taking turns within every repeat (so a burst of load on a shared machine hits all of
them alike). A trial's time is the slowest rank's mean per call; the row reports the median trial
and the spread (min and max), and `vs_native`: the median over repeats of native's time over this
algorithm's in the same repeat (> 1: faster than torch's own). Bandwidths are, as nccl-tests
reports them (its doc/PERFORMANCE.md):

    algbw = size / time
    busbw = algbw * 2 (n-1)/n   all-reduce
            algbw * (n-1)/n     all-gather, reduce-scatter (size = the whole gathered buffer), all-to-all
                                (size = one rank's input, n equal chunks)
            algbw * 1           broadcast

busbw is the figure comparable across rank counts and with the link's bandwidth. The table is
printed, and written as collectives.csv with a plot of the median busbw against size (the
min-max spread shaded), collectives.png.
"""

from __future__ import annotations

import csv
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from plait.comm import algorithms as alg
from plait.errors import ConfigError
from plait.report.plots import plt, save
from plait.testing import RankPool

# op -> algorithms available for it
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "allreduce": ("native", "ring", "tree", "hierarchical"),
    "allgather": ("native", "ring"),
    "reduce_scatter": ("native", "ring"),
    "broadcast": ("native", "tree"),
    "alltoall": ("native",),  # what expert parallel's token exchange runs (plait.models.moe), with equal splits here
}
ELEMENT_BYTES = 4  # float32


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth correction for op on n ranks."""
    return {"allreduce": 2 * (n - 1) / n, "allgather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "broadcast": 1.0, "alltoall": (n - 1) / n}[op]


def parse_size(text: str) -> int:
    """'64M' -> 67108864 bytes (K, M, G are powers of 1024)."""
    t = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        value = int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise ConfigError(f"size {text!r} is not a number of bytes such as 1K, 64M or 4096") from None
    if value < 1:
        raise ConfigError(f"size {text!r} must be at least 1 byte")
    return value


def parse_sizes(text: str, factor: int = 2) -> list[int]:
    """'1K:64M' -> 1K, 2K, 4K, ... 64M (times `factor` each step); '1K,1M' -> exactly those."""
    if ":" in text:
        lo, _, hi = text.partition(":")
        a, b = parse_size(lo), parse_size(hi)
        if a > b:
            raise ConfigError(f"--sizes {text}: the first size must not exceed the last")
        if factor < 2:
            raise ConfigError(f"--factor {factor} must be >= 2")
        out = [a]
        while out[-1] * factor <= b:
            out.append(out[-1] * factor)
        return out
    return [parse_size(s) for s in text.split(",") if s.strip()]


def human(nbytes: float) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g}{unit}"
    return f"{nbytes:g}"


@dataclass
class BenchOptions:
    ops: list[str] = field(default_factory=lambda: ["allreduce"])
    algos: list[str] = field(default_factory=lambda: ["native", "ring", "tree"])
    sizes: list[int] = field(default_factory=lambda: parse_sizes("1K:64M"))
    ranks: int = 2
    iters: int = 20
    warmup: int = 3
    repeats: int = 5  # timed trials per point; the row gives their median and spread
    max_seconds: float = 1.0  # per trial: fewer calls when one call is slow (at least 2; all ranks agree)
    local_size: int = 0  # hierarchical: ranks per node (0: half the ranks)
    out: Path | None = None

    def validate(self) -> BenchOptions:
        for op in self.ops:
            if op not in ALGORITHMS:
                raise ConfigError(f"unknown collective {op!r}; choose from {', '.join(ALGORITHMS)}")
        known = sorted({a for algos in ALGORITHMS.values() for a in algos})
        for algo in self.algos:
            if algo not in known:
                raise ConfigError(f"unknown algorithm {algo!r}; choose from {', '.join(known)}")
        if not 2 <= self.ranks <= 8:
            raise ConfigError(f"--ranks {self.ranks}: the benchmark runs 2 to 8 local ranks")
        if self.iters < 1 or self.warmup < 0 or self.repeats < 1:
            raise ConfigError(f"--iters ({self.iters}) and --repeats ({self.repeats}) must be >= 1 and --warmup "
                              f"({self.warmup}) >= 0")
        return self

    def left_out(self) -> list[str]:
        """One line per collective for which some asked-for algorithms do not exist (they are skipped for it)."""
        lines = []
        for op in self.ops:
            missing = [a for a in self.algos if a not in ALGORITHMS[op]]
            if missing:
                lines.append(f"{op}: {', '.join(missing)} left out ({op} runs {', '.join(ALGORITHMS[op])} here)")
        return lines


def _call(op: str, algo: str, buf, out, local_size: int):
    import torch.distributed as dist

    if op == "allreduce":
        if algo == "native":
            return dist.all_reduce(buf)
        if algo == "hierarchical":
            return alg.hierarchical_all_reduce(buf, local_size)
        return alg.ALL_REDUCE[algo](buf)
    if op == "allgather":
        return dist.all_gather_single(out, buf) if algo == "native" else alg.ring_all_gather(out, buf)
    if op == "reduce_scatter":
        return dist.reduce_scatter_single(out, buf) if algo == "native" else alg.ring_reduce_scatter(out, buf)
    if op == "alltoall":
        return dist.all_to_all_single(out, buf)
    return dist.broadcast(buf, 0) if algo == "native" else alg.tree_broadcast(buf, 0)


def _buffers(op: str, nbytes: int, n: int, seed: int):
    """(input, output) for one call of op whose nccl-tests size is nbytes (whole gathered / scattered buffer)."""
    import torch

    count = max(n, nbytes // ELEMENT_BYTES)
    count -= count % n if op in ("allgather", "reduce_scatter", "alltoall") else 0
    g = torch.Generator().manual_seed(seed)
    if op == "allgather":
        return torch.randint(-8, 8, (count // n,), generator=g).float(), torch.empty(count)
    if op == "reduce_scatter":
        return torch.randint(-8, 8, (count,), generator=g).float(), torch.empty(count // n)
    if op == "alltoall":
        return torch.randint(-8, 8, (count,), generator=g).float(), torch.empty(count)
    return torch.randint(-8, 8, (count,), generator=g).float(), None


def _slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _calls_per_trial(op: str, algo: str, buf, out, local_size: int, opts: BenchOptions) -> int:
    """`iters`, or fewer (at least 2) where one call (the slowest rank's) would overrun max_seconds; the same on every rank."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    _call(op, algo, buf, out, local_size)
    return max(2, min(opts.iters, int(opts.max_seconds / max(_slowest(time.perf_counter() - t0), 1e-9))))


def _trial(op: str, algo: str, buf, out, local_size: int, calls: int) -> tuple[float, list[float]]:
    """(seconds per call over `calls` calls, the slowest rank's mean; this rank's seconds for each call)."""
    import torch.distributed as dist

    dist.barrier()
    each = []
    t0 = time.perf_counter()
    for _ in range(calls):
        start = time.perf_counter()
        _call(op, algo, buf, out, local_size)
        each.append(time.perf_counter() - start)
    return _slowest((time.perf_counter() - t0) / calls), each


def bench_rank(opts: BenchOptions) -> list[dict]:
    """Pool task: the sweep on this rank; rank 0 returns the rows."""
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    local_size = opts.local_size or max(1, n // 2)
    rows = []
    for op in opts.ops:
        algos = [a for a in opts.algos if a in ALGORITHMS[op]]
        for nbytes in opts.sizes:
            bufs, correct, calls = {}, {}, {}
            for algo in algos:
                buf, out = _buffers(op, nbytes, n, seed=rank + 17)
                ref_in, ref_out = buf.clone(), (out.clone() if out is not None else None)
                _call(op, "native", ref_in, ref_out, local_size)
                _call(op, algo, buf, out, local_size)
                got, want = (out, ref_out) if out is not None else (buf, ref_in)
                ok = torch.tensor([float(torch.equal(got, want))])
                dist.all_reduce(ok, op=dist.ReduceOp.MIN)
                correct[algo] = bool(ok.item())
                buf.zero_()  # sums of zeros: timing without overflow
                for _ in range(opts.warmup):
                    _call(op, algo, buf, out, local_size)
                bufs[algo] = (buf, out)
                calls[algo] = _calls_per_trial(op, algo, buf, out, local_size, opts)
            times: dict[str, list[float]] = {algo: [] for algo in algos}
            each: dict[str, list[float]] = {algo: [] for algo in algos}
            for _ in range(opts.repeats):  # the algorithms take turns: load bursts hit them alike
                for algo in algos:
                    mean, mine = _trial(op, algo, *bufs[algo], local_size, calls[algo])
                    times[algo].append(mean)
                    each[algo] += mine
            buf, out = bufs[algos[0]]
            size = (out if op == "allgather" else buf).numel() * ELEMENT_BYTES
            for algo in algos:
                rows.append(_row(op, algo, n, size, times[algo], times.get("native"), correct[algo], each[algo]))
    return rows if rank == 0 else []


STALL = 3.0  # a call that takes this many times the median call has stalled (waited for a core, a retransmit)


def _row(op: str, algo: str, n: int, size: int, times: list[float], native: list[float] | None, correct: bool,
         calls: list[float] | None = None) -> dict:
    """One table row from the repeats' times (seconds per call); with `calls` (rank 0's seconds for each timed
    call) also the median call and the share of calls that stalled, which set a trial's mean on a busy machine."""
    median, factor = statistics.median(times), busbw_factor(op, n)
    algbw = size / median / 1e9
    per_call = {}
    if calls:
        typical = statistics.median(calls)
        per_call = {"call_median_us": typical * 1e6, "stalled": sum(c > STALL * typical for c in calls) / len(calls)}
    return {"op": op, "algo": algo, "ranks": n, "size_bytes": size, "count": size // ELEMENT_BYTES,
            "repeats": len(times), "time_us": median * 1e6, "time_min_us": min(times) * 1e6,
            "time_max_us": max(times) * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * factor,
            "busbw_min_GBps": size / max(times) / 1e9 * factor, "busbw_max_GBps": size / min(times) / 1e9 * factor,
            "vs_native": statistics.median(a / b for a, b in zip(native, times)) if native else None,
            "correct": correct} | per_call


def format_table(rows: list[dict]) -> str:
    """One line per row: medians, the busbw spread over the repeats and the ratio to native."""
    lines = [f"{'op':<15}{'size':>9}{'count':>12}  {'algo':<13}{'time(us)':>12}{'algbw(GB/s)':>13}{'busbw(GB/s)':>13}"
             f"{'busbw min-max':>16}{'vs native':>11}  {'check':<5}"]
    for r in rows:
        spread = f"{r['busbw_min_GBps']:.3f}-{r['busbw_max_GBps']:.3f}"
        ratio = f"{r['vs_native']:.2f}x" if r.get("vs_native") is not None else "-"
        lines.append(f"{r['op']:<15}{human(r['size_bytes']):>9}{r['count']:>12}  {r['algo']:<13}{r['time_us']:>12.1f}"
                     f"{r['algbw_GBps']:>13.3f}{r['busbw_GBps']:>13.3f}{spread:>16}{ratio:>11}"
                     f"  {'ok' if r['correct'] else 'WRONG':<5}")
    return "\n".join(lines)


def write_csv(rows: list[dict], path: Path) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def plot(rows: list[dict], path: Path) -> Path:
    ops = list(dict.fromkeys(r["op"] for r in rows))
    fig, axes = plt.subplots(1, len(ops), figsize=(5 * len(ops), 4), squeeze=False)
    for ax, op in zip(axes[0], ops):
        for algo in dict.fromkeys(r["algo"] for r in rows if r["op"] == op):
            mine = [r for r in rows if r["op"] == op and r["algo"] == algo]
            line, = ax.plot([r["size_bytes"] for r in mine], [r["busbw_GBps"] for r in mine], marker="o", ms=3, label=algo)
            if all("busbw_min_GBps" in r for r in mine):
                ax.fill_between([r["size_bytes"] for r in mine], [r["busbw_min_GBps"] for r in mine],
                                [r["busbw_max_GBps"] for r in mine], color=line.get_color(), alpha=0.2)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"{op}, {rows[0]['ranks']} ranks")
        ax.grid(alpha=0.3)
        ax.legend()
    save(fig, path)
    return path


def run_collectives(opts: BenchOptions, echo=print) -> list[dict]:
    """Run the sweep on opts.ranks local gloo processes; print the table and write CSV + PNG to opts.out."""
    opts.validate()
    with RankPool(opts.ranks, timeout_s=600) as pool:
        rows = pool.run(bench_rank, opts)[0]
    echo(format_table(rows))
    if opts.out is not None:
        opts.out.mkdir(parents=True, exist_ok=True)
        echo(f"wrote {write_csv(rows, opts.out / 'collectives.csv')} and {plot(rows, opts.out / 'collectives.png')}")
    wrong = [r for r in rows if not r["correct"]]
    if wrong:
        echo(f"warning: {len(wrong)} result(s) differ from torch's own collective")
    return rows
