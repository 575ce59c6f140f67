"""Memory of parallel.offload = "disk" and of ZeRO-3's shard-only initialisation, each against its baseline.

1. Disk offload: one process trains an MLP on digits (AdamW) with offload = none, then disk, each in a
   fresh process; prints each peak RSS (VmHWM), the AdamW state's bytes (2 x fp32 per parameter) and the
   saving as a share of them. Baseline: offload = none in the same run.
2. Shard-only init: 2 gloo ranks build a GPT and shard it with FSDP2 (ZeRO-3), once by building the whole
   model on every rank and once on the meta device with only the shards materialised; prints the growth
   of each rank's peak RSS during the build and the parameter bytes counted at materialisation.

    python benchmarks/offload_memory.py [--width 2048] [--depth 3] [--gpt-width 512] [--gpt-layers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

RSS_SCRIPT = """
import json, sys
from plait.config import load_config
from plait.train.trainer import train
result = train(load_config(None, sys.argv[1:]), None)
hwm = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024
print(json.dumps({"hwm": hwm, "loss": result.summary["final_loss"], "params": result.summary["params"]}))
"""


def hwm() -> int:
    return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024


def build(width: int, layers: int, meta: bool):
    """Rank task: the peak-RSS growth of building and sharding the GPT, and the counted bytes (meta only)."""
    import torch

    from plait.config import load_config
    from plait.data import build_data
    from plait.models import build_model
    from plait.models.meta import build_on_meta, materialize
    from plait.parallel.fsdp import apply_fsdp
    from plait.train.job import check_job

    cfg = load_config(None, ["model.name='gpt'", "data.name='stdlib-text'", f"model.width={width}",
                             f"model.layers={layers}", "model.heads=8", "model.context=64", "parallel.dp=2",
                             "parallel.zero=3"])
    rt = check_job(cfg).init_runtime(cfg.launch)
    spec = build_data(cfg.data, cfg.model).spec
    torch.manual_seed(0)
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS: the peak of the build alone
        f.write("5")
    before = hwm()
    figures, whole = None, None
    if meta:
        module, record = build_on_meta(lambda: build_model(cfg.model, spec))
        module = apply_fsdp(module, rt.mesh["dp"], 3)
        figures = materialize(module, record, rt.device)
    else:
        module = build_model(cfg.model, spec)
        whole = 4 * sum(p.numel() for p in module.parameters())
        module = apply_fsdp(module, rt.mesh["dp"], 3)
    return {"rss_growth": hwm() - before, "figures": figures, "whole": whole}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--gpt-width", type=int, default=512)
    ap.add_argument("--gpt-layers", type=int, default=8)
    a = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    mlp = ["model.name='mlp'", "data.name='digits'", f"model.width={a.width}", f"model.depth={a.depth}",
           "parallel.dp=1", "train.steps=3", "train.global_batch_size=16", "train.micro_batch_size=16",
           "train.eval_samples=32", "log.progress=false", "log.report=false"]
    runs = {}
    for mode in ("none", "disk"):
        out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, *mlp, f"parallel.offload='{mode}'"], env=env,
                             capture_output=True, text=True, check=True)
        runs[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    mib = 2**20
    state = 8 * runs["none"]["params"]
    saved = runs["none"]["hwm"] - runs["disk"]["hwm"]
    print(f"disk offload, mlp width {a.width} depth {a.depth} ({runs['none']['params']:,} parameters, AdamW state "
          f"{state / mib:.1f} MiB):")
    for mode, r in runs.items():
        print(f"  offload = {mode:5s} peak RSS {r['hwm'] / mib:8.1f} MiB  final loss {r['loss']:.6f}")
    print(f"  saving {saved / mib:.1f} MiB = {saved / state:.2f} x the optimizer state")

    from plait.testing import run_distributed

    print(f"shard-only init, gpt width {a.gpt_width} layers {a.gpt_layers}, ZeRO-3 on 2 ranks:")
    whole = run_distributed(build, 2, a.gpt_width, a.gpt_layers, False, timeout_s=600)
    meta = run_distributed(build, 2, a.gpt_width, a.gpt_layers, True, timeout_s=600)
    for rank in range(2):
        f = meta[rank]["figures"]
        print(f"  rank {rank}: whole-model build: peak RSS +{whole[rank]['rss_growth'] / mib:.1f} MiB "
              f"(the model is {whole[rank]['whole'] / mib:.1f} MiB);  shard-only: peak RSS "
              f"+{meta[rank]['rss_growth'] / mib:.1f} MiB, counted {f['local_bytes'] / mib:.1f} MiB of shards, "
              f"at most {f['peak_bytes'] / mib:.1f} MiB while materialising")


if __name__ == "__main__":
    main()
