"""Parameter server placement: dedicated server processes against servers colocated in the workers (BytePS style).

    python benchmarks/ps_placement.py [--dp 2] [--servers 1] [--mode sync] [--steps 100] [--width 512] [--micro 64]
                                      [--repeats 3]

The same job (mlp on digits, `--width` hidden units, `--dp` workers) with parallel.sync = 'ps' twice:

* dedicated (the baseline): `--servers` server processes beside the dp workers; each worker pushes its
  whole gradient over RPC and pulls the whole model back.
* colocated (parallel.ps_placement = 'colocated'): dp processes, worker k also serves shard k of dp; its
  own shard's push and pull are calls inside the process.

Bytes sent per step: the chief's gradient bytes pushed over RPC (comm_bytes in metrics.jsonl, counted),
next to the arithmetic: dedicated = all parameters' bytes, colocated = all but the chief's own shard,
about (dp - 1) / dp. Step time: the median over the run's logging windows after the first (steps
log.every + 1 .. steps). Figures are medians over --repeats runs, interleaved so that drifting machine
load falls on both alike; ratios are colocated / dedicated measured in the same run of this script.
On a machine with fewer cores than dp + servers processes, the dedicated layout also pays for its
extra processes sharing the cores: say so when quoting its step time.
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

PLACEMENTS = ("dedicated", "colocated")


def run(out: Path, a, placement: str) -> dict:
    every = max(1, a.steps // 10)
    sets = ["model.name=mlp", "data.name=digits", f"model.width={a.width}", "parallel.sync=ps", f"parallel.dp={a.dp}",
            f"parallel.ps_mode={a.mode}", f"parallel.ps_servers={a.servers}", f"parallel.ps_placement={placement}",
            f"train.steps={a.steps}", f"train.global_batch_size={a.micro * a.dp}", f"train.micro_batch_size={a.micro}",
            f"log.every={every}", "log.progress=false", "log.report=false", "checkpoint.every=0", "train.eval_every=0",
            "train.eval_samples=64", "launch.nproc_per_node=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    r = subprocess.run([sys.executable, "-m", "plait", "train", *[x for s in sets for x in ("--set", s)], "--out", str(out)],
                       env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"{placement} run failed:\n{r.stdout}\n{r.stderr}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    windows = [x for x in rows if "step_time_s" in x][1:] or [x for x in rows if "step_time_s" in x]
    return {"bytes": statistics.median(x["comm_bytes"] for x in windows),
            "step_s": statistics.median(x["step_time_s"] for x in windows)}


def expected_bytes(a) -> tuple[int, int]:
    """(all parameters' bytes, the chief's own shard's bytes) for this model, as the job computes the shards."""
    from plait.config import load_config
    from plait.data import build_data
    from plait.models import build_model
    from plait.parallel.ps import shards

    cfg = load_config(None, ["model.name='mlp'", "data.name='digits'", f"model.width={a.width}"])
    model = build_model(cfg.model, build_data(cfg.data, cfg.model).spec)
    named = dict(model.named_parameters())
    own = 0
    for name, lo, hi in shards(model, a.dp, rows=True)[0]:  # the chief's row blocks
        q = named[name]
        own += q.numel() * q.element_size() * ((hi - lo) / q.shape[0] if lo is not None else 1)
    return sum(q.numel() * q.element_size() for q in named.values()), int(own)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--servers", type=int, default=1, help="dedicated server processes (the baseline)")
    ap.add_argument("--mode", default="sync", choices=("sync", "async", "ssp"))
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--micro", type=int, default=64, help="samples per worker per step")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    total, own = expected_bytes(a)
    results: dict[str, list[dict]] = {p: [] for p in PLACEMENTS}
    with tempfile.TemporaryDirectory() as d:
        for rep in range(a.repeats):
            for p in PLACEMENTS:
                results[p].append(run(Path(d) / f"{rep}-{p}", a, p))
    med = {p: {k: statistics.median(r[k] for r in results[p]) for k in ("bytes", "step_s")} for p in PLACEMENTS}
    formula = {"dedicated": total, "colocated": total - own}
    print(f"parameter server ({a.mode}), mlp width {a.width} on digits, dp={a.dp} workers, {a.micro} samples per worker "
          f"per step, {a.steps} steps; baseline: {a.servers} dedicated server(s) ({a.dp + a.servers} processes) against "
          f"colocated ({a.dp} processes); median of {a.repeats}, {os.cpu_count()} cores")
    print(f"{'placement':<12}{'bytes sent/step (chief)':>25}{'formula':>12}{'vs dedicated':>14}{'step ms':>10}"
          f"{'vs dedicated':>14}")
    for p in PLACEMENTS:
        print(f"{p:<12}{med[p]['bytes']:>25,.0f}{formula[p]:>12,}{med[p]['bytes'] / med['dedicated']['bytes']:>13.3f}x"
              f"{med[p]['step_s'] * 1000:>10.2f}{med[p]['step_s'] / med['dedicated']['step_s']:>13.3f}x")
    print(f"target: colocated bytes = (dp - 1) / dp = {(a.dp - 1) / a.dp:.3f}x of dedicated up to the shards' balance "
          f"(the chief's own shard is {own / total:.3f} of the parameters)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
