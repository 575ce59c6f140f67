"""A dense GPT next to a mixture-of-experts GPT with the same active parameters per token, and the all-to-all's bus bandwidth.

    dense  the default job's GPT (4 blocks, width 128, context 128) on stdlib-text
    moe    the same GPT whose every --every-th block is an MoE layer of --experts experts, top-1 (Switch):
           each expert has the dense MLP's shape, so a token meets the dense model's parameters
           (+ a width x E router per MoE block), while the MoE blocks hold E times the MLP parameters.
           Expert parallel: parallel.ep = --ranks (each rank holds E / ranks experts), dense part DDP.

Both train the same steps on the same data order and global batch (32 sequences, AdamW, the default
schedule and clipping) on --ranks gloo ranks (plait.testing.RankPool, one thread each), in one
invocation. The table: validation loss (the fixed validation set, the task loss alone), step time
(the median of the logged windows' mean step times after the first window), parameters (total and
active per token) and memory per rank from summary.json (parameters, gradients, optimizer state: the
experts counted at E / ranks per rank), and the MoE run's routing figures from metrics.jsonl.

The all-to-all: bytes a rank sends to other ranks per step in the MoE layers' token exchange and the
seconds it spends in it (the layer counts both; gloo's all_to_all_single blocks, so the host time is
the transfer), hence its bus bandwidth (nccl-tests' busbw for all-to-all, (n-1)/n of the input over
the time, is exactly the bytes that leave a rank over the time). It is compared with `plait bench
collectives --ops alltoall` (plait.comm.bench, equal splits) at the MoE exchange's mean message size.

    python benchmarks/moe.py [--steps 200] [--experts 4] [--every 1] [--ranks 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from plait.comm.bench import BenchOptions, bench_rank
from plait.config import load_config
from plait.testing import RankPool


def config(steps: int, ranks: int, extra: tuple = ()):
    return load_config(None, [f"parallel.dp={ranks}", f"train.steps={steps}", "log.every=10", "log.progress=false",
                              "log.report=false", "train.sample_tokens=0", "checkpoint.every=0", *extra])


def run(cfg, run_dir: str) -> dict | None:
    """Pool task: train; rank 0 returns the summary and the metrics records."""
    import torch.distributed as dist

    from plait.train.trainer import train

    summary = train(cfg, Path(run_dir)).summary
    if dist.get_rank() != 0:
        return None
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {"summary": summary, "rows": [r for r in rows if "loss" in r]}


def active_params(summary: dict, cfg) -> int:
    """Parameters one token meets: all of them for the dense GPT; with top-1 MoE the routers, one expert per MoE
    block, and the rest."""
    m = cfg.model
    if not m.moe_experts:
        return summary["params"]
    h, e, k = m.width, m.moe_experts, m.moe_top_k
    expert = h * 4 * h + 4 * h + 4 * h * h + h
    layers = m.layers // m.moe_every
    return summary["params"] - layers * (e - k) * expert


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--ranks", type=int, default=2)
    a = ap.parse_args()
    moe = (f"model.moe_experts={a.experts}", "model.moe_top_k=1", f"model.moe_every={a.every}",
           "model.moe_aux_weight=0.01", f"parallel.ep={a.ranks}")
    cfgs = {"dense": config(a.steps, a.ranks), "moe": config(a.steps, a.ranks, moe)}
    results = {}
    with RankPool(a.ranks, timeout_s=600) as pool, tempfile.TemporaryDirectory() as tmp:
        for name, cfg in cfgs.items():
            print(f"training {name} ...", flush=True)
            results[name] = pool.run(run, cfg, f"{tmp}/{name}")[0]
        moe_rows = results["moe"]["rows"][1:]
        a2a_bytes = statistics.mean(r["moe_a2a_bytes"] for r in moe_rows)
        a2a_s = statistics.mean(r["moe_a2a_s"] for r in moe_rows)
        cfg = cfgs["moe"]
        layers = cfg.model.layers // cfg.model.moe_every
        calls = 4 * layers * (cfg.train.global_batch_size // (cfg.train.micro_batch_size * a.ranks))
        per_call = a2a_bytes / calls  # bytes one rank sends elsewhere in one all-to-all
        size = int(per_call * a.ranks / (a.ranks - 1))  # the equal-split input buffer that sends as much elsewhere
        bench = pool.run(bench_rank, BenchOptions(ops=["alltoall"], algos=["native"], sizes=[size], ranks=a.ranks,
                                                  iters=50, max_seconds=2.0))[0][0]

    print(f"\n{a.ranks} gloo ranks, {a.steps} steps, global batch {cfgs['dense'].train.global_batch_size} x "
          f"{cfgs['dense'].model.context} tokens; MoE: {a.experts} experts top-1 in every {a.every} block(s), ep = {a.ranks}\n")
    head = f"{'':8}{'val loss':>10}{'ms/step':>10}{'params':>10}{'active':>10}{'params MB':>11}{'grads MB':>10}{'optim MB':>10}"
    print(head)
    for name, r in results.items():
        s = r["summary"]
        step = statistics.median(x["step_time_s"] for x in r["rows"][1:]) * 1000
        mem = s["memory"]["per_rank"][0]
        print(f"{name:8}{s['val_loss']:>10.4f}{step:>10.1f}{s['params'] / 1e6:>9.2f}M"
              f"{active_params(s, cfgs[name]) / 1e6:>9.2f}M{mem['params_bytes'] / 1e6:>11.2f}"
              f"{mem['grads_bytes'] / 1e6:>10.2f}{mem['optimizer_bytes'] / 1e6:>10.2f}")
    last = results["moe"]["rows"][-1]
    loads = [sum(layer) for layer in last["moe_tokens_per_expert"]]
    worst = max(max(layer) / (total / len(layer)) for layer, total in zip(last["moe_tokens_per_expert"], loads))
    print(f"\nMoE routing (last window): aux loss {last['moe_aux_loss']:.3f} over {layers} layers, dropped "
          f"{last['moe_dropped']:.1%}, busiest expert {worst:.2f}x its even share")
    busbw = a2a_bytes / a2a_s / 1e9
    print(f"all-to-all in training: {a2a_bytes / 1e6:.2f} MB sent per rank per step in {calls} calls "
          f"({per_call / 1e3:.1f} KB each), {a2a_s * 1000:.1f} ms -> busbw {busbw:.3f} GB/s")
    print(f"plait bench collectives --ops alltoall --sizes {size}: {bench['time_us']:.0f} us per call -> busbw "
          f"{bench['busbw_GBps']:.3f} GB/s; training reaches {busbw / bench['busbw_GBps']:.0%} of it")


if __name__ == "__main__":
    main()
