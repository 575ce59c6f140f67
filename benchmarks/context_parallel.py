"""Context parallel on long sequences: memory, step time and the ring's overlap at cp = 1, 2, 4, beside the planner.

    python benchmarks/context_parallel.py [--seqs 1024,2048,4096,8192,16384] [--cps 1,2,4] [--steps 3]

For each sequence length and cp degree, cp fresh gloo ranks (plait.testing.run_distributed) train a 2-block GPT of
width 64 (2 heads, vocabulary 64) on one sequence a step with SGD: cp = 1 is plain SDPA on one process, cp > 1 the
zig-zag layout and ring attention (plait.parallel.context). Per row, rank 0's figures (every rank's are alike: the
layout gives each the same work):

    act MB      the activations autograd saves in one forward (plait's accounting, train.memory.ActivationMeter)
    plan MB     the planner's prediction of the same (plait.plan.memory.predict_memory)
    rss MB      the rank's peak resident memory (a fresh process each row, cp = 1 too: torch and plait are ~300 MB of it)
    step ms     the median step (forward, backward, SGD), over --steps after one warm-up step
    ring ms     per step: computing the ring's blocks, and blocked waiting for its transfers (what overlap left)
    overlap     1 - wait / transfer, where transfer is the same ring exchanges timed alone (K, V and dK, dV per
                block, every step of the ring, forward and backward), in the same processes

Ranks beyond the machine's cores share them (cp = 4 on 2 cores): step times then include that; memory does not.
Prints the machine's load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

WIDTH, HEADS, LAYERS, VOCAB = 64, 2, 2, 64


def rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one_rank(seq: int, steps: int) -> dict:
    """In a rank (or alone): train the GPT on sequences of `seq` tokens; this rank's figures."""
    import torch
    import torch.distributed as dist

    from plait.models.gpt import GPT
    from plait.parallel.context import apply_cp, shard
    from plait.train.loss import lm_loss
    from plait.train.memory import ActivationMeter

    torch.set_num_threads(1)
    cp = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if cp > 1 else 0
    torch.manual_seed(0)
    model = GPT(VOCAB, seq, WIDTH, HEADS, LAYERS)
    stats: dict = {}
    if cp > 1:
        apply_cp(model, dist.group.WORLD, stats)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    times, act = [], 0
    for step in range(steps + 1):
        x, y = torch.randint(0, VOCAB, (1, seq), generator=g), torch.randint(0, VOCAB, (1, seq), generator=g)
        if cp > 1:
            x, y = shard(x, y, cp, rank)
            dist.barrier()
        if step == 1:
            stats.clear()  # the warm-up step is left out
        meter = ActivationMeter(model)
        t0 = time.perf_counter()
        with meter.measure():
            loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step:
            times.append(time.perf_counter() - t0)
        act = meter.peak
    out = {"act_mb": act / 2**20, "rss_mb": rss_mb(), "step_ms": 1e3 * statistics.median(times)}
    if cp > 1:
        out |= {"compute_ms": 1e3 * stats.get("compute_s", 0.0) / steps, "wait_ms": 1e3 * stats.get("wait_s", 0.0) / steps,
                "transfer_ms": 1e3 * transfer_s(seq, cp)}
    return out


def transfer_s(seq: int, cp: int) -> float:
    """Seconds one training step's ring transfers take alone: per block, cp - 1 hops of K and V in forward and again in
    backward, and cp hops of the float32 dK, dV accumulators."""
    import torch
    import torch.distributed as dist

    from plait.comm.ring_attention import _Ring, _wait

    ring = _Ring(dist.group.WORLD)
    kv = torch.randn(2, 1, HEADS, seq // cp, WIDTH // HEADS)
    reps = 3
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        for _ in range(LAYERS):
            for _ in range(2 * (cp - 1)):
                _wait(ring.shift(kv, 81)[1])
            for _ in range(cp):
                _wait(ring.shift(kv, 82)[1])
    return (time.perf_counter() - t0) / reps


def planned_mb(seq: int, cp: int) -> float:
    from plait.config import load_config
    from plait.parallel.layout import Layout
    from plait.plan.memory import Shape, activation_bytes

    cfg = load_config(None, [f"model.context={seq}", f"model.width={WIDTH}", f"model.heads={HEADS}",
                             f"model.layers={LAYERS}", "model.tie_embeddings=true"])
    shape = Shape.from_config(cfg.model, VOCAB)
    return sum(activation_bytes(shape, Layout(dp=1, cp=cp, micro_batch=1))[0]) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    ap.add_argument("--cps", default="1,2,4")
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from plait.testing import run_distributed

    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    head = f"{'seq':>6} {'cp':>3} {'act MB':>8} {'plan MB':>8} {'rss MB':>8} {'step ms':>9} {'ring ms':>15} {'overlap':>8}"
    print(head)
    print("-" * len(head))
    for seq in [int(s) for s in a.seqs.split(",")]:
        for cp in [int(c) for c in a.cps.split(",")]:
            r = run_distributed(one_rank, cp, seq, a.steps, timeout_s=900)[0]
            ring = overlap = "-"
            if cp > 1:
                ring = f"{r['compute_ms']:.0f} + {r['wait_ms']:.0f} wait"
                overlap = f"{max(0.0, 1 - r['wait_ms'] / r['transfer_ms']):.0%}" if r["transfer_ms"] else "-"
            print(f"{seq:>6} {cp:>3} {r['act_mb']:>8.1f} {planned_mb(seq, cp):>8.1f} {r['rss_mb']:>8.0f} "
                  f"{r['step_ms']:>9.0f} {ring:>15} {overlap:>8}", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
