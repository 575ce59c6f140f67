"""`plait plan --calibrate`: measure this machine for the cost model instead of trusting datasheets.

Runs `world` local processes (gloo on CPU; the device each would train on otherwise) at once, so
that what they share (cores, memory bandwidth) is in the numbers:

* matmul throughput per dtype (FLOP/s per process), and the efficiency the configured model
  reaches on it (a real forward + backward of its blocks at the micro-batch size),
* latency and bandwidth of all-reduce, all-gather, reduce-scatter and send/recv, fitted as
  t = latency + bytes / bandwidth over sizes from 16 KiB to 4 MiB, for groups of 2 and of `world`,
* what a sharded layer costs beyond its compute share and its communication: 2-way tensor parallel
  (with and without sequence parallel) and ZeRO-3 (see _layer_overheads),
* the optimizer's time per parameter (an AdamW step),
* the cores the processes share (a pipeline's idle stages leave theirs to the busy ones: cost.pipeline_time).

Timings that are differences (a layer more, a sharded layer against a plain one, a micro-batch of
16 against one of 1) are taken round by round and their median kept (_interleaved): the machine
may be shared, and load that comes and goes must not land on one side of a difference only.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from plait.data.spec import DataSpec
from plait.models import build_model
from plait.parallel.fsdp import _on_local_shards as on_local_shards  # the trainer's ZeRO-3 step, timed as it runs
from plait.parallel.fsdp import apply_fsdp, overlap_without_streams
from plait.parallel.gradsync import align_grads
from plait.parallel.layout import Layout
from plait.parallel.tp import apply_tp
from plait.plan.cost import Hardware, flops_per_step, tp_outside_comm
from plait.plan.memory import Shape
from plait.testing import RankPool
from plait.train.loss import lm_loss

SIZES = [1 << k for k in range(14, 23)]  # 16 KiB .. 4 MiB


def _timeit(fn, min_s: float = 0.3, reps: int = 3) -> float:
    fn()
    best = []
    for _ in range(reps):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            if time.perf_counter() - t0 > min_s / reps:
                break
        best.append((time.perf_counter() - t0) / n)
    return min(best)


def _matmul_flops(dtype: torch.dtype, n: int = 512) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n ** 3 / _timeit(lambda: a @ b)


def _fit(points: list[tuple[float, float]]) -> dict:
    """Least squares t = latency + bytes / bw."""
    xs, ys = zip(*points)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    slope = max(slope, 1e-15)
    return {"latency_s": max(0.0, my - slope * mx), "bw": 1.0 / slope}


def _op(op: str, x: torch.Tensor, full: torch.Tensor, group, ranks: list[int], me: int):
    """One call of `op` on `group` with buffers of the measured size."""
    if op == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    if op == "all_gather":
        return lambda: dist.all_gather_single(full, x, group=group)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(x, full, group=group)
    peer = ranks[1] if me == ranks[0] else ranks[0]

    def round_trip():
        if me == ranks[0]:
            dist.send(x, peer, group=group)
            dist.recv(x, peer, group=group)
        elif me == ranks[1]:
            dist.recv(x, peer, group=group)
            dist.send(x, peer, group=group)

    return round_trip


def _collectives(group, n: int) -> dict:
    out = {}
    me = dist.get_rank()
    ranks = dist.get_process_group_ranks(group)
    if me not in ranks:
        return out
    for op in ("all_reduce", "all_gather", "reduce_scatter", "send"):
        pts = []
        for size in SIZES:
            fn = _op(op, torch.zeros(size // 4), torch.zeros(size // 4 * n), group, ranks, me)
            dist.barrier(group=group)
            # A fixed number of calls: every rank must make the same collectives.
            calls = 20 if size <= 1 << 18 else 6
            fn()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            t = (time.perf_counter() - t0) / calls
            if op == "send":
                t /= 2  # a round trip is two sends
            # the size the cost model passes: the gradient/activation tensor (the full buffer for the gathers)
            nbytes = size * n if op in ("all_gather", "reduce_scatter") else size
            pts.append((float(nbytes), t))
        out[f"{op}/{n}"] = _fit(pts)
    return out


def _model_efficiency(model_cfg, vocab: int, micro: int, peak: float) -> tuple[float, float]:
    """(efficiency at large micro-batches, fixed seconds per micro-batch), from forward + backward at two sizes."""
    spec = DataSpec(name="calibrate", task="lm", vocab_size=vocab, tokens_per_sample=model_cfg.context)
    model = build_model(model_cfg, spec)
    shape = Shape.from_config(model_cfg, vocab)
    big = max(2, micro)
    xs = {b: torch.randint(0, vocab, (b, model_cfg.context)) for b in (1, big)}
    fns = {b: (lambda x=x: lm_loss(model(x), x).backward()) for b, x in xs.items()}
    # t(b) = overhead + flops(b) / (peak * efficiency): two sizes give both, round by round (see _interleaved)
    rounds = _interleaved(fns, calls={1: 8, big: 2}, rounds=7)
    per_sample = statistics.median((r[big] - r[1]) / (big - 1) for r in rounds)
    overhead = max(0.0, statistics.median(r[1] - (r[big] - r[1]) / (big - 1) for r in rounds))
    efficiency = flops_per_step(shape, 1) / per_sample / peak if per_sample > 0 else \
        flops_per_step(shape, big) / statistics.median(r[big] for r in rounds) / peak
    return min(efficiency, 1.5), overhead


def _interleaved(fns: dict, calls: int | dict = 4, rounds: int = 5) -> list[dict]:
    """Seconds per call of each fn, measured in turn round after round: [{key: seconds}] per round.

    On a machine that other work shares, load comes and goes within seconds; a quantity that is a
    difference of timings (one more layer, a sharded layer against a plain one) is taken per round,
    from timings a moment apart, and its median over rounds is what counts. Every rank makes the
    same calls (a collective inside a fn needs its peers)."""
    for fn in fns.values():
        fn()
    out = []
    for _ in range(rounds):
        row = {}
        for key, fn in fns.items():
            n = calls[key] if isinstance(calls, dict) else calls
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            row[key] = (time.perf_counter() - t0) / n
        out.append(row)
    return out


def _layer_overheads(model_cfg, vocab: int, micro: int, comm: dict, overhead: float) -> dict:
    """What a sharded layer costs beyond its share of the compute and its communication (DTensor's
    dispatch and redistribution, FSDP's hooks and copies, the split matmuls' lower efficiency);
    `overhead` is the fixed cost of a micro-batch (_model_efficiency), which tensor parallel does not split:

    * "tp", "tp_sp": a 2-way tensor-parallel layer, without and with sequence parallel, per layer and
      micro-batch (gradient alignment and the optimizer's step on DTensors included), as [seconds,
      seconds per sample] fitted at two micro-batch sizes, from the whole model against the plain one;
    * "fsdp": a ZeRO-3 (fully_shard) layer over all ranks, per layer and step, as the trainer runs it
      (asynchronous collectives on CPU, the optimizer stepped on the local shards), from a model of 3
      layers against one of 1. ZeRO-2 is one fully_shard group for the whole model: no per-layer cost.
    """
    world = dist.get_world_size()
    tp_mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    dp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    spec = DataSpec(name="calibrate", task="lm", vocab_size=vocab, tokens_per_sample=model_cfg.context)
    gen = torch.Generator().manual_seed(0)
    small = max(1, micro // 4)
    xs = {b: torch.randint(0, vocab, (b, model_cfg.context), generator=gen) for b in {small, micro}}
    out = _tp_overheads(model_cfg, vocab, spec, xs, comm, overhead, tp_mesh)
    out["fsdp"] = _fsdp_overhead(model_cfg, spec, xs[micro], comm, dp_mesh)
    return out


def _stepper(model_cfg, spec: DataSpec, x: torch.Tensor, layers: int, wrap=None):
    """One training step on `x` of a model of `layers` blocks as plait's trainer runs it (forward, backward, the
    gradient alignment tensor parallel does, a no-op elsewhere, and the optimizer step), and its parameter
    count. `wrap(model)` shards it and returns the ZeRO-3 reduce-scatter to wait for, if any."""
    torch.manual_seed(0)
    model = build_model(replace(model_cfg, layers=layers, dropout=0.0), spec)
    n = sum(p.numel() for p in model.parameters())
    pending = wrap(model) if wrap is not None else None
    opt = torch.optim.AdamW(model.parameters())

    def step(model=model, opt=opt, x=x):
        lm_loss(model(x), x).backward()
        if pending is not None:
            pending.wait()
        align_grads(model.parameters())
        if pending is not None and opt.state:  # ZeRO-3 steps the DTensors' local shards (plait.parallel.fsdp)
            with on_local_shards(opt):
                opt.step()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)

    return step, n


def _collective_s(comm: dict, op: str, nbytes: float, n: int) -> float:
    """Seconds of one collective on n ranks, from the collectives just measured on them."""
    return Hardware(comm=comm, devices_per_node=n).collective(op, nbytes, n, n)


def _tp_overheads(model_cfg, vocab: int, spec: DataSpec, xs: dict, comm: dict, overhead: float, tp_mesh) -> dict:
    """The "tp" and "tp_sp" entries of _layer_overheads: [seconds, seconds per sample] per layer and micro-batch.

    The whole model, plain and 2-way tensor parallel with and without sequence parallel, at two micro-batch
    sizes, timed round by round: what tensor parallel costs beyond what the cost model already counts (half
    the plain step's compute and optimizer, the whole fixed cost of a micro-batch, the collectives' bytes)
    is its per-layer cost. A whole model, not one layer more: the difference is `layers` times larger than
    the timing noise of a shared machine, and the embedding's and head's DTensor costs count too."""
    wraps = {"plain": None, "tp": lambda m: apply_tp(m, tp_mesh, False) and None,
             "tp_sp": lambda m: apply_tp(m, tp_mesh, True) and None}
    fns = {(kind, b): _stepper(model_cfg, spec, xs[b], model_cfg.layers, wrap)[0]
           for kind, wrap in wraps.items() for b in sorted(xs)}
    rounds = _interleaved(fns, calls=2, rounds=5)
    shape, two = Shape.from_config(model_cfg, vocab), Hardware(comm=comm, devices_per_node=2)
    small, micro = min(xs), max(xs)
    out = {}
    for key in ("tp", "tp_sp"):
        def extra(r, b, key=key):
            counted = 4 * model_cfg.layers * _collective_s(comm, "all_reduce", 4 * b * model_cfg.context * model_cfg.width, 2) + \
                tp_outside_comm(shape, Layout(tp=2, micro_batch=b, sequence_parallel=key == "tp_sp"), two)
            return (r[(key, b)] - (r[("plain", b)] - overhead) / 2 - overhead - counted) / model_cfg.layers
        at = {b: statistics.median(extra(r, b) for r in rounds) for b in xs}
        per_sample = max(0.0, (at[micro] - at[small]) / (micro - small)) if micro > small else 0.0
        out[key] = [max(0.0, at[micro] - per_sample * micro), per_sample]
    return out


def _fsdp_overhead(model_cfg, spec: DataSpec, x: torch.Tensor, comm: dict, dp_mesh) -> float:
    """The "fsdp" entry of _layer_overheads: seconds per ZeRO-3 layer and step over all ranks, beyond its collectives.

    The per-layer cost of fully_shard is small next to a layer's compute: 3 layers against 1, sharded and plain."""
    def zero3(model):
        apply_fsdp(model, dp_mesh, 3)
        return overlap_without_streams(model, dp_mesh, 3)

    world = dist.get_world_size()
    fns, params = {}, {}
    for kind, wrap in (("plain", None), ("fsdp", zero3)):
        for layers in (1, 3):
            fns[(kind, layers)], params[layers] = _stepper(model_cfg, spec, x, layers, wrap)
    rounds = _interleaved(fns, calls=3, rounds=5)
    nbytes = 4 * (params[3] - params[1]) // 2
    comm_s = 2 * _collective_s(comm, "all_gather", nbytes, world) + _collective_s(comm, "reduce_scatter", nbytes, world)
    sharded = statistics.median((r[("fsdp", 3)] - r[("fsdp", 1)] - r[("plain", 3)] + r[("plain", 1)]) / 2 for r in rounds)
    return max(0.0, sharded - comm_s)


def _median(values: list):
    """The median over ranks of a number, or of each entry of a list."""
    if isinstance(values[0], list):
        return [statistics.median(v[i] for v in values) for i in range(len(values[0]))]
    return statistics.median(values)


def measure(model_cfg, vocab: int, micro: int) -> dict:
    """Pool task: every rank measures; rank 0 returns the profile's fields."""
    torch.manual_seed(dist.get_rank())
    world = dist.get_world_size()
    flops = {str(dt).replace("torch.", ""): _matmul_flops(dt) for dt in (torch.float32, torch.bfloat16)}
    eff, overhead = _model_efficiency(model_cfg, vocab, micro, flops["float32"])
    comm = {}
    pair = dist.new_group([0, 1]) if world >= 2 else None
    if pair is not None:
        comm.update(_collectives(pair, 2))
    if world > 2:
        comm.update(_collectives(dist.group.WORLD, world))
    overheads = _layer_overheads(model_cfg, vocab, micro, comm, overhead) if world % 2 == 0 else {}
    p = torch.nn.Parameter(torch.randn(1 << 20))
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p])
    per_param = statistics.median(r[0] for r in _interleaved({0: opt.step}, calls=3, rounds=5)) / p.numel()
    out = [None] * world
    dist.all_gather_object(out, {"flops": flops, "eff": eff, "overhead": overhead, "per_param": per_param,
                                 "layers": overheads, "threads": torch.get_num_threads()})
    if dist.get_rank() != 0:
        return None
    return {"flops": {k: min(o["flops"][k] for o in out) for k in flops}, "efficiency": statistics.median(o["eff"] for o in out),
            "overhead": statistics.median(o["overhead"] for o in out),
            "optimizer_s_per_param": max(o["per_param"] for o in out), "comm": comm, "world": world,
            "threads": max(o["threads"] for o in out),
            "layer_overhead_s": {k: _median([o["layers"][k] for o in out]) for k in overheads}}


def calibrate(model_cfg, vocab: int, micro: int, world: int = 2, pool: RankPool | None = None) -> Hardware:
    """Measure `world` local processes (those of `pool` when given) and return (not yet saved) the device profile."""
    if pool is not None:
        m = pool.run(measure, model_cfg, vocab, micro)[0]
    else:
        with RankPool(world, timeout_s=600) as pool:
            m = pool.run(measure, model_cfg, vocab, micro)[0]
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / world
    # the ranks' share of this host's cores: a rank waiting in a collective leaves its core to the others
    cores = max(1, len(os.sched_getaffinity(0)) // m.get("threads", 1))
    return Hardware(name=f"calibrated: {world} CPU processes on {os.cpu_count()} cores", memory_bytes=mem,
                    flops=m["flops"]["float32"], efficiency=m["efficiency"], devices_per_node=world, overlap=0.0,
                    microbatch_overhead_s=m["overhead"], layer_overhead_s=m["layer_overhead_s"],
                    optimizer_s_per_param=m["optimizer_s_per_param"], comm=m["comm"], cores=cores)
