"""DeepFM at every layout of Deep Learning at Scale ch. 9's exercises, side by side, as the chapter compares them.

    python benchmarks/deepfm_layouts.py [--steps 40] [--rows ex3,ex4]

Each row is one `plait train` of the same DeepFM on the synthetic click log (fields of 8 to 32768 categories),
the same global batch, seed and AdamW: one process, data parallel (replicated tables), row-sharded tables
(the DLRM layout), the pipeline over collectives (exercise 3), over RPC (exercise 4), tensor parallel with
and without sharded tables (exercise 5), and everything at once on 8 processes (exercise 6). Printed per row:
the median step time after the first 5 steps, the bytes each rank sends per step (the most of any rank),
the parameter + gradient + optimizer bytes the fullest rank holds, its peak RSS, and the validation loss
(every row trains the same trajectory, so the losses agree to float rounding).

On 2 cores the 4- and 8-process rows share 2 cores: their step times measure the machine's oversubscription
as much as the layout; the bytes columns do not depend on it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROWS = {  # name: (what it is, overrides)
    "one": ("one process", ["parallel.dp=1"]),
    "dp2": ("data parallel, tables replicated", ["parallel.dp=2"]),
    "dp2-row": ("data parallel, tables row-sharded", ["parallel.dp=2", "parallel.embedding_sharding='row'"]),
    "ex3": ("ex. 3 pipeline (collective 1F1B)", ["parallel.dp=1", "parallel.pp=2"]),
    "ex4": ("ex. 4 pipeline over RPC", ["parallel.dp=1", "parallel.pp=2", "parallel.pp_schedule='gpipe'",
                                        "parallel.pp_transport='rpc'"]),
    "ex5": ("ex. 5 tensor parallel", ["parallel.dp=1", "parallel.tp=2"]),
    "ex5-row": ("ex. 5 dp x tp, tables row-sharded", ["parallel.dp=2", "parallel.tp=2",
                                                       "parallel.embedding_sharding='row'"]),
    "ex6": ("ex. 6 dp x pp x tp, tables row-sharded", ["parallel.dp=2", "parallel.pp=2", "parallel.tp=2",
                                                        "parallel.embedding_sharding='row'"]),
}
BASE = ["model.name='deepfm'", "data.name='clicks'", "model.width=128", "model.embedding_dim=16", "model.depth=3",
        "data.synthetic_samples=20000", "train.global_batch_size=256", "train.micro_batch_size=64",
        "train.eval_samples=2000", "train.eval_batch_size=500", "log.every=1", "log.progress=false",
        "log.report=false", "checkpoint.every=0"]


def run(out: Path, steps: int, overrides: list[str]) -> dict:
    sets = [*BASE, f"train.steps={steps}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    r = subprocess.run([sys.executable, "-m", "plait", "train", *[a for s in sets for a in ("--set", s)], "--out", str(out)],
                       env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"run failed ({' '.join(overrides)}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    s = json.loads((out / "summary.json").read_text())
    mem = s["memory"]["per_rank"]
    return {
        "processes": s["world_size"],
        "step_ms": 1000 * statistics.median(x["step_time_s"] for x in rows if "step_time_s" in x and x["step"] > 5),
        "sent_kb": max(s["comm"]["bytes_per_step_per_rank"]) / 1e3,
        "state_mb": max(m["params_bytes"] + m["grads_bytes"] + m["optimizer_bytes"] for m in mem) / 1e6,
        "rss_mb": max(m["peak_rss_bytes"] for m in mem) / 1e6,
        "val_loss": s["val_loss"],
    }


def table(results: dict[str, dict]) -> str:
    lines = ["| layout | processes | step ms | sent per step per rank (KB) | params + grads + optimizer, fullest rank "
             "(MB) | peak RSS (MB) | val loss |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in results.items():
        lines.append(f"| {ROWS[name][0]} | {r['processes']} | {r['step_ms']:.1f} | {r['sent_kb']:.1f} | "
                     f"{r['state_mb']:.2f} | {r['rss_mb']:.0f} | {r['val_loss']:.4f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    a = ap.parse_args()
    names = [n for n in a.rows.split(",") if n]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        sys.exit(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            print(f"{name}: {ROWS[name][0]} ...", file=sys.stderr, flush=True)
            results[name] = run(Path(tmp) / name, a.steps, ROWS[name][1])
    print(f"load average {os.getloadavg()[0]:.2f}")
    print(table(results))
    if any("tp=2" in " ".join(ROWS[n][1]) for n in names):
        print("\nsent: tensor parallel's own collectives (DTensor's functional collectives) are not counted; the tp rows "
              "show the rest (dp, pipeline, the tables' exchange)")


if __name__ == "__main__":
    main()
