"""`plait plan --calibrate`: measure this machine for the cost model instead of trusting datasheets.

Runs `world` local processes (gloo on CPU; the device each would train on otherwise) at once, so
that what they share (cores, memory bandwidth) is in the numbers:

* matmul throughput per dtype (FLOP/s per process), and the efficiency the configured model
  reaches on it (a real forward + backward of its blocks at the micro-batch size),
* latency and bandwidth of all-reduce, all-gather, reduce-scatter and send/recv, fitted as
  t = latency + bytes / bandwidth over sizes from 16 KiB to 4 MiB, for groups of 2 and of `world`,
* what a sharded layer costs beyond its compute share and its communication: 2-way tensor parallel
  (with and without sequence parallel) and ZeRO-3 (see _layer_overheads),
* the optimizer's time per parameter (an AdamW step).
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from plait.data.spec import DataSpec
from plait.models import build_model
from plait.parallel.fsdp import apply_fsdp
from plait.parallel.gradsync import align_grads
from plait.parallel.tp import apply_tp
from plait.plan.cost import Hardware, flops_per_step
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
    times = {}
    for b in (1, big):
        x = torch.randint(0, vocab, (b, model_cfg.context))
        times[b] = _timeit(lambda x=x: lm_loss(model(x), x).backward(), min_s=0.6)
    # t(b) = overhead + flops(b) / (peak * efficiency): two sizes give both
    per_sample = (times[big] - times[1]) / (big - 1)
    overhead = max(0.0, times[1] - per_sample)
    efficiency = flops_per_step(shape, 1) / per_sample / peak if per_sample > 0 else flops_per_step(shape, big) / times[big] / peak
    return min(efficiency, 1.5), overhead


def _fixed_time(fn, calls: int = 6, reps: int = 2) -> float:
    """Seconds per call over a fixed number of calls (every rank of a collective must make the same ones)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def _layer_overheads(model_cfg, vocab: int, micro: int, comm: dict) -> dict:
    """What a sharded layer costs beyond its share of the compute and its communication (DTensor's
    dispatch and redistribution, FSDP's hooks and copies, the split matmuls' lower efficiency),
    measured as the difference between a model of 2 layers and one of 1 (so the embedding and head
    do not count):

    * "tp", "tp_sp": a 2-way tensor-parallel layer, without and with sequence parallel, per layer and
      micro-batch (gradient alignment and the optimizer's step on DTensors included), as [seconds,
      seconds per sample] fitted at two micro-batch sizes;
    * "fsdp": a ZeRO-3 (fully_shard) layer over all ranks, per layer and step, optimizer included.
    """
    from dataclasses import replace

    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    tp_mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    dp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    spec = DataSpec(name="calibrate", task="lm", vocab_size=vocab, tokens_per_sample=model_cfg.context)
    gen = torch.Generator().manual_seed(0)
    small = max(1, micro // 4)
    xs = {b: torch.randint(0, vocab, (b, model_cfg.context), generator=gen) for b in {small, micro}}

    def layer(b: int, wrap=None, more: int = 1) -> tuple[float, int]:
        """(seconds, parameters) of one more layer, from models of 1 and 1 + `more` layers: forward, backward,
        the gradient alignment tensor parallel does (a no-op elsewhere) and the optimizer step."""
        t, n = {}, {}
        for layers in (1, 1 + more):
            torch.manual_seed(0)
            model = build_model(replace(model_cfg, layers=layers, dropout=0.0), spec)
            n[layers] = sum(p.numel() for p in model.parameters())
            if wrap is not None:
                wrap(model)
            opt = torch.optim.AdamW(model.parameters())

            def step(model=model, opt=opt, x=xs[b]):
                lm_loss(model(x), x).backward()
                align_grads(model.parameters())
                opt.step()
                opt.zero_grad()

            t[layers] = _fixed_time(step, calls=4 * (1 + more), reps=3) if more > 1 else _fixed_time(step)
        return (t[1 + more] - t[1]) / more, (n[1 + more] - n[1]) // more

    def cost(op: str, nbytes: float, n: int) -> float:  # from the collectives just measured on these n ranks
        return Hardware(comm=comm, devices_per_node=n).collective(op, nbytes, n, n)

    out = {}
    plains = {b: layer(b)[0] for b in sorted(xs)}
    for key, sp in (("tp", False), ("tp_sp", True)):
        extra = {}
        for b, plain in plains.items():
            tp, _ = layer(b, lambda m, sp=sp: apply_tp(m, tp_mesh, sp))
            extra[b] = tp - plain / 2 - 4 * cost("all_reduce", 4 * b * model_cfg.context * model_cfg.width, 2)
        per_sample = max(0.0, (extra[micro] - extra[small]) / (micro - small)) if micro > small else 0.0
        out[key] = [max(0.0, extra[micro] - per_sample * micro), per_sample]
    # the per-layer cost of fully_shard is small next to a layer's compute: 3 layers against 1, more calls
    plain, params = layer(micro, more=2)
    sharded, _ = layer(micro, lambda m: apply_fsdp(m, dp_mesh, 3), more=2)
    nbytes = 4 * params
    comm_s = 2 * cost("all_gather", nbytes, world) + cost("reduce_scatter", nbytes, world)
    out["fsdp"] = max(0.0, sharded - plain - comm_s)
    return out


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
    overheads = _layer_overheads(model_cfg, vocab, micro, comm) if world % 2 == 0 else {}
    p = torch.nn.Parameter(torch.randn(1 << 20))
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p])
    per_param = _timeit(opt.step) / p.numel()
    out = [None] * world
    dist.all_gather_object(out, {"flops": flops, "eff": eff, "overhead": overhead, "per_param": per_param,
                                 "layers": overheads})
    if dist.get_rank() != 0:
        return None
    return {"flops": {k: min(o["flops"][k] for o in out) for k in flops}, "efficiency": statistics.median(o["eff"] for o in out),
            "overhead": statistics.median(o["overhead"] for o in out),
            "optimizer_s_per_param": max(o["per_param"] for o in out), "comm": comm, "world": world,
            "layer_overhead_s": {k: _median([o["layers"][k] for o in out]) for k in overheads}}


def calibrate(model_cfg, vocab: int, micro: int, world: int = 2) -> Hardware:
    """Measure `world` local processes and return (not yet saved) the device profile."""
    with RankPool(world, timeout_s=600) as pool:
        m = pool.run(measure, model_cfg, vocab, micro)[0]
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / world
    return Hardware(name=f"calibrated: {world} CPU processes on {os.cpu_count()} cores", memory_bytes=mem,
                    flops=m["flops"]["float32"], efficiency=m["efficiency"], devices_per_node=world, overlap=0.0,
                    microbatch_overhead_s=m["overhead"], layer_overhead_s=m["layer_overhead_s"],
                    optimizer_s_per_param=m["optimizer_s_per_param"], comm=m["comm"])
