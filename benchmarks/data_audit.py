"""Data audit on digits with 10 % of the labels flipped: does `plait data audit` find the flips, and does
training without them help?

    python benchmarks/data_audit.py [--flip 0.1] [--folds 5] [--epochs 10] [--train-epochs 100] [--set model.width=256] [--out DIR]

scikit-learn's digits (1797 images) are split (seeded) into a clean test set (20 %) and the rest,
whose labels are flipped at random to another class for `--flip` of the samples (seeded). The rest
is written as a tensors file and audited (plait's trainer, K folds, cleanlab). Printed: precision
and recall of the flagged labels against the flips, and the clean test accuracy of the configured
model trained on all samples and with `data.exclude = audit.json`; and, for volume reduction, the accuracy
on the audit's EL2N coreset (`coreset.json`, half the data) against a random subset of the same size.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from plait.audit.audit import run_audit
from plait.config import load_config

# A model big enough to memorise the flipped labels (width 256, no weight decay, many epochs): what label noise costs.
MODEL = ["model.name='mlp'", "model.width=256", "model.depth=1", "train.global_batch_size=64", "optim.lr=1e-2",
         "optim.weight_decay=0", "optim.warmup_steps=0", "optim.grad_clip=0", "log.progress=false", "log.report=false",
         "train.sample_tokens=0",
         "checkpoint.every=0", "parallel.dp=1", "data.name='tensors'"]


def flipped_digits(out: Path, flip: float, seed: int = 0):
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.from_numpy(d.images).float().div(16.0).unsqueeze(1)
    y = torch.from_numpy(d.target).long()
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(x), generator=g)
    test, rest = perm[: len(x) // 5], perm[len(x) // 5:]
    xr, yr = x[rest], y[rest].clone()
    flips = torch.randperm(len(rest), generator=g)[: int(round(flip * len(rest)))]
    yr[flips] = (yr[flips] + torch.randint(1, 10, (len(flips),), generator=g)) % 10  # always another class
    path = out / "digits_flipped.pt"
    torch.save({"x": xr, "y": yr}, path)
    return path, set(flips.tolist()), x[test], y[test]


def test_accuracy(cfg, x, y) -> float:
    from plait.train.trainer import train

    model = train(cfg, None).module
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flip", type=float, default=0.1)
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--epochs", type=float, default=10, help="epochs of each cross-validation model")
    ap.add_argument("--train-epochs", type=float, default=100, help="epochs of the final models (with / without exclusion)")
    ap.add_argument("--out", type=Path, default=Path("runs/data-audit"))
    ap.add_argument("--set", action="append", default=[], help="config overrides for every model (e.g. model.width=128)")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    path, flips, xt, yt = flipped_digits(a.out, a.flip)
    base = [*MODEL, f"data.path='{path}'", *a.set]
    report = run_audit(load_config(None, base), a.out / "audit", folds=a.folds, epochs=a.epochs)
    flagged = set(report["label_issues"]["indices"])
    tp = len(flagged & flips)
    precision, recall = tp / max(1, len(flagged)), tp / max(1, len(flips))
    n = report["source"]["samples"] - report["source"]["validation_samples"]
    steps = math.ceil(a.train_epochs * n / 64)
    acc_all = test_accuracy(load_config(None, [*base, f"train.steps={steps}"]), xt, yt)
    excl = [*base, f"train.steps={steps}", f"data.exclude='{a.out / 'audit' / 'audit.json'}'"]
    acc_excl = test_accuracy(load_config(None, excl), xt, yt)
    # volume reduction: the EL2N coreset (report["volume_reduction"]) against a random subset of the same size, both
    # without the flagged samples
    core = report["volume_reduction"]
    unflagged = sorted(set(range(report["source"]["samples"])) - set(report["exclude"]))
    g = torch.Generator().manual_seed(1)
    rand_keep = {unflagged[i] for i in torch.randperm(len(unflagged), generator=g)[: core["kept"]].tolist()}
    (a.out / "random_subset.json").write_text(json.dumps(
        {"exclude": sorted(set(range(report["source"]["samples"])) - rand_keep)}))
    acc_core = test_accuracy(load_config(None, [*base, f"train.steps={steps}",
                                                f"data.exclude='{a.out / 'audit' / 'coreset.json'}'"]), xt, yt)
    acc_rand = test_accuracy(load_config(None, [*base, f"train.steps={steps}",
                                                f"data.exclude='{a.out / 'random_subset.json'}'"]), xt, yt)
    result = {"flipped": len(flips), "flagged": len(flagged), "true_positives": tp, "precision": precision,
              "recall": recall, "test_accuracy_all": acc_all, "test_accuracy_excluded": acc_excl,
              "excluded": len(report["exclude"]), "test_samples": len(yt), "coreset_kept": core["kept"],
              "test_accuracy_coreset": acc_core, "test_accuracy_random_subset": acc_rand}
    print(f"digits, {len(flips)} of {report['source']['samples']} labels flipped ({a.flip:.0%}); audit: {a.folds} folds x "
          f"{a.epochs:g} epochs; models: {' '.join(MODEL[:3] + a.set)}, final ones {a.train_epochs:g} epochs")
    print(f"flagged {len(flagged)}: precision {precision:.3f}, recall {recall:.3f}")
    print(f"{'clean test accuracy':<28} {'all samples':>12} {'excluded':>10}")
    print(f"{'(' + str(len(yt)) + ' held-out digits)':<28} {acc_all:>12.3f} {acc_excl:>10.3f}")
    print(f"volume reduction to {core['kept']} samples ({core['keep_fraction']:.0%}), flagged excluded: EL2N coreset "
          f"{acc_core:.3f}, random subset {acc_rand:.3f}")
    (a.out / "result.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
