"""Meta-learning against training from scratch on the same K shots, on classes never trained on.

    python benchmarks/meta_learning.py [--steps 300] [--seeds 3] [--ways 3] [--shots 5] [--dp 1]

For each algorithm (Reptile at outer lr 1.0, first-order MAML at 0.1: each the better of {0.1, 0.3, 1.0} on
seed 1234) and seed, one `plait train --set train.objective=meta` run of an MLP on digits episodes (classes 0-6),
then the query accuracy on 256 held-out episodes (classes 7-9) after adapting with the training's inner steps, from
the meta-learned weights and from a fresh initialisation, with the same inner steps and with ten times as many.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

BIN = Path(sys.executable).parent
LR = {"reptile": 1.0, "fomaml": 0.1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--ways", type=int, default=3)
    ap.add_argument("--shots", type=int, default=5)
    ap.add_argument("--inner-steps", type=int, default=5)
    ap.add_argument("--dp", type=int, default=1)
    a = ap.parse_args()
    from plait.models import build_model
    from plait.models.fewshot import episode_accuracy
    from plait.train.build import data_bundle
    from plait.train.weights import load_run_model

    rows: dict[str, list[tuple[float, ...]]] = {k: [] for k in LR}
    with tempfile.TemporaryDirectory() as d:
        for algorithm, lr in LR.items():
            for seed in range(1234, 1234 + a.seeds):
                run = Path(d) / f"{algorithm}-{seed}"
                sets = ["data.name=digits", "model.name=mlp", "train.objective=meta", f"train.meta_algorithm={algorithm}",
                        f"data.ways={a.ways}", f"data.shots={a.shots}", f"train.inner_steps={a.inner_steps}",
                        f"train.seed={seed}", f"train.steps={a.steps}", f"parallel.dp={a.dp}", "optim.name=sgd",
                        f"optim.lr={lr}", "optim.momentum=0", "optim.weight_decay=0", "optim.warmup_steps=0",
                        "optim.grad_clip=0", "train.global_batch_size=8", f"train.micro_batch_size={8 // a.dp}",
                        "train.eval_every=0", "train.eval_samples=256", "log.progress=false", "log.report=false"]
                subprocess.run([str(BIN / "plait"), "train", *[x for s in sets for x in ("--set", s)], "--out",
                                str(run)], check=True, capture_output=True)
                cfg, spec, learner = load_run_model(run)
                val = data_bundle(cfg).val  # the held-out episodes
                meta = episode_accuracy(learner, val, 256)
                torch.manual_seed(seed + 1)
                fresh = build_model(cfg.model, spec)
                scratch = episode_accuracy(fresh, val, 256)
                longer, fresh_longer = copy.deepcopy(learner), copy.deepcopy(fresh)
                longer.inner_steps = fresh_longer.inner_steps = 10 * a.inner_steps
                rows[algorithm].append((meta, scratch, episode_accuracy(longer, val, 256),
                                        episode_accuracy(fresh_longer, val, 256)))
    print(f"load average {os.getloadavg()[0]:.2f}; mlp on digits, {a.ways}-way {a.shots}-shot, {a.steps} outer steps "
          f"of 8 episodes, {a.inner_steps} inner steps, dp {a.dp}, {a.seeds} seeds; accuracy on 256 held-out episodes "
          "(median, min-max over seeds)")
    k, k10 = a.inner_steps, 10 * a.inner_steps
    print(f"\n| algorithm | meta-learned, {k} steps | from scratch, {k} steps | meta-learned, {k10} steps | "
          f"from scratch, {k10} steps |\n|---|---:|---:|---:|---:|")
    for algorithm, got in rows.items():
        cells = [f"{statistics.median(c):.3f} ({min(c):.3f}-{max(c):.3f})" for c in zip(*got)]
        print(f"| {algorithm} (outer lr {LR[algorithm]}) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
