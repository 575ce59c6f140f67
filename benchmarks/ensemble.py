"""A deep ensemble against its own members: validation accuracy and loss of each member and of the ensemble.

    python benchmarks/ensemble.py [--members 5] [--steps 300] [--model mlp] [--data digits] [--width 32] [--dp 1]

With --dp a multiple of --members the members are spread over the ranks (dp / K ranks each); the accuracies do not
depend on it (each member follows its own run), the training time does.

One `plait train --set model.ensemble=K` run (each member from its own init seed, the same batches), exported; the
members and the ensemble (the members' mean probability) are then evaluated on the whole validation split.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

BIN = Path(sys.executable).parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--members", type=int, default=5)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--data", default="digits")
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--dp", type=int, default=1)
    a = ap.parse_args()
    from plait.config import load_config
    from plait.data import build_data
    from plait.export import load_exported

    sets = [f"model.name={a.model}", f"data.name={a.data}", f"model.width={a.width}", f"model.ensemble={a.members}",
            f"parallel.dp={a.dp}", f"train.steps={a.steps}", "train.global_batch_size=32", "train.micro_batch_size=32",
            "log.progress=false", "log.report=false"]
    with tempfile.TemporaryDirectory() as d:
        run = Path(d) / "run"
        subprocess.run([str(BIN / "plait"), "train", *[x for s in sets for x in ("--set", s)], "--out", str(run)],
                       check=True, capture_output=True)
        subprocess.run([str(BIN / "plait"), "export", str(run), "-o", str(Path(d) / "m.safetensors")], check=True,
                       capture_output=True)
        ens, _ = load_exported(Path(d) / "m.safetensors")
        summary = json.loads((run / "summary.json").read_text())
    cfg = load_config(None, sets)
    val = build_data(cfg.data, cfg.model).val
    x, y = val.fetch(torch.arange(len(val)))
    ens.eval()
    rows = []
    with torch.no_grad():
        for k, m in enumerate(ens.members):
            logits = m(x)
            rows.append((f"member {k}", (logits.argmax(-1) == y).double().mean().item(),
                         torch.nn.functional.cross_entropy(logits, y).item()))
        logp = ens(x)
        rows.append(("ensemble", (logp.argmax(-1) == y).double().mean().item(),
                     torch.nn.functional.nll_loss(logp, y).item()))
    print(f"load average {os.getloadavg()[0]:.2f}; {a.model} width {a.width} on {a.data}, {a.steps} steps, "
          f"{len(y)} validation samples; dp {a.dp} ({summary['parallel']['strategy']}): training "
          f"{summary['train_time_s']:.1f} s")
    print("\n| model | val accuracy | val loss |\n|---|---:|---:|")
    for name, acc, loss in rows:
        print(f"| {name} | {acc:.3f} | {loss:.4f} |")
    mean_acc = sum(r[1] for r in rows[:-1]) / (len(rows) - 1)
    print(f"\nmembers' mean accuracy {mean_acc:.3f}; ensemble {rows[-1][1]:.3f}")


if __name__ == "__main__":
    main()
