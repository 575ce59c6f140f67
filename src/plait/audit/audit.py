"""`plait data audit`: what is wrong with a classification dataset, sample by sample.

    report = run_audit(cfg, Path("audit"), folds=5, epochs=10)   # writes audit/audit.json and audit/report.html

The whole source (its training and validation parts) is audited. K-fold cross-validation trains
the configured model with plait's own trainer (one process) on K-1 folds and predicts the held-out
fold, so every sample gets an out-of-fold predicted probability vector. From those:

- label_issues: cleanlab's confident learning (`cleanlab.filter.find_label_issues`, prune by noise
  rate), ranked by self-confidence, each with the given and the suggested label;
- duplicates: exact (the same input bytes) and near (cosine similarity of the standardised inputs
  above `near` = 0.995), and leakage: pairs split across training and validation;
- outliers: the 1 % of samples farthest from their 5th nearest neighbour (inputs' first principal components;
  plait.audit.outliers, which also runs across the ranks of a process group and flags the same samples);
- class_balance: counts per class and the ratio of the largest to the smallest;
- el2n: the EL2N score |p - onehot(y)| of every sample (Paul et al. 2021), and how many are "easy"
  (below 0.1), and volume_reduction: a coreset of the `keep` fraction with the highest EL2N among
  the unflagged samples (the rest listed under "prune"; `DIR/coreset.json` excludes them).

Every flagged sample is named by its index in the source (`source_index`: the row of a tensors
file, the sample of digits, the file of an image folder in sorted order; image folders also give
the path). `exclude` lists the label issues and the later copy of each exact duplicate: train
without them with `data.exclude = "DIR/audit.json"`.
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
import json
import math
import tempfile
from pathlib import Path

import numpy as np
import torch

from plait.audit.outliers import flag, kth_distances
from plait.config import Config, apply_overrides
from plait.data import build_data
from plait.errors import DataError

NEAR = 0.995
EASY_EL2N = 0.1


def whole_source(cfg: Config):
    """All samples of the configured source: inputs, labels, source indices, names, and which are validation."""
    data_cfg = cfg.data
    saved = data_cfg.exclude
    data_cfg.exclude = ""  # the audit looks at everything
    try:
        bundle = build_data(data_cfg, cfg.model)
    finally:
        data_cfg.exclude = saved
    if bundle.spec.task != "classification":
        raise DataError(f"plait data audit checks labels of classification data; data.name = {cfg.data.name!r} is a "
                        f"{bundle.spec.task!r} task")
    xs, ys, src, is_val, names = [], [], [], [], []
    for part, val in ((bundle.train, False), (bundle.val, True)):
        ids = getattr(part, "source_index", None)
        if ids is None:
            raise DataError(f"data.name = {cfg.data.name!r} does not name its samples by source index; audit digits, "
                            "synthetic, tensors, images or their packed forms")
        n = len(part)
        for start in range(0, n, 512):
            x, y = part.fetch(torch.arange(start, min(n, start + 512)))
            xs.append(x.float())
            ys.append(y.long())
        src.append(torch.as_tensor(ids))
        is_val += [val] * n
        files = getattr(part, "files", None)
        names += [str(f) for f in files] if files is not None else [None] * n
    x, y, s = torch.cat(xs), torch.cat(ys), torch.cat(src)
    order = s.argsort()  # source order
    return (x[order], y[order], s[order], torch.tensor(is_val)[order], [names[i] for i in order.tolist()],
            bundle.spec.num_classes)


def _fold_config(cfg: Config, path: Path, steps: int) -> Config:
    import copy

    c = copy.deepcopy(cfg)
    c.data.exclude = ""
    c.data.augment = []
    apply_overrides(c, ["data.name='tensors'", f"data.path='{path}'", "data.val_fraction=0.01", f"train.steps={steps}",
                        "parallel.dp=1", "parallel.tp=1", "parallel.pp=1", "parallel.zero=0", "log.progress=false",
                        "log.report=false", "checkpoint.every=0", "train.eval_every=0", "train.eval_samples=8",
                        "train.eval_batch_size=8", "train.sample_tokens=0", "train.stop_after=0",
                        "launch.nproc_per_node=0", "data.workers=0"])
    c.optim.warmup_steps = min(c.optim.warmup_steps, max(0, steps // 10))
    c.train.micro_batch_size = c.train.global_batch_size
    return c


def fit_predict(cfg: Config, x_train, y_train, x_test, classes: int, epochs: float, work: Path) -> np.ndarray:
    """Train the configured model with plait's trainer on (x_train, y_train); softmax probabilities of x_test."""
    from plait.train.trainer import train  # lazily: `plait data pack` imports this module and trains nothing

    work.mkdir(parents=True, exist_ok=True)
    path = work / "fold.pt"
    torch.save({"x": x_train, "y": y_train}, path)
    steps = max(1, math.ceil(epochs * len(x_train) / cfg.train.global_batch_size))
    fcfg = _fold_config(cfg, path, steps)
    model = train(fcfg, None).module  # the plain model
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(x_test[i:i + 512]) for i in range(0, len(x_test), 512)])
    p = torch.softmax(logits.float(), -1).numpy()
    if p.shape[1] < classes:  # a class absent from this fold's training part: probability 0
        p = np.concatenate([p, np.zeros((len(p), classes - p.shape[1]))], 1)
    return p


def out_of_fold(cfg: Config, x, y, classes: int, folds: int, epochs: float, work: Path) -> np.ndarray:
    if folds < 2 or folds > len(x):
        raise DataError(f"--folds {folds} must be between 2 and the number of samples ({len(x)})")
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(cfg.train.seed))
    probs = np.zeros((len(x), classes))
    for k in range(folds):
        held = perm[k::folds]
        keep = torch.ones(len(x), dtype=torch.bool)
        keep[held] = False
        probs[held.numpy()] = fit_predict(cfg, x[keep], y[keep], x[held], classes, epochs, work / f"fold{k}")
    return probs


def duplicates(x: torch.Tensor, is_val: torch.Tensor, src: torch.Tensor) -> dict:
    flat = x.reshape(len(x), -1).numpy()
    first: dict[str, int] = {}
    exact = []
    for i, row in enumerate(flat):
        h = hashlib.sha1(np.ascontiguousarray(row).tobytes()).hexdigest()
        if h in first:
            exact.append([int(src[first[h]]), int(src[i])])
        else:
            first[h] = i
    z = (flat - flat.mean(0)) / (flat.std(0) + 1e-8)
    z /= np.linalg.norm(z, axis=1, keepdims=True) + 1e-12
    near = []
    for start in range(0, len(z), 1024):
        sim = z[start:start + 1024] @ z.T
        for a, b in zip(*np.nonzero(sim > NEAR)):
            i = start + int(a)
            if i < int(b):
                near.append([int(src[i]), int(src[int(b)]), round(float(sim[a, b]), 5)])
    pos = {int(s): i for i, s in enumerate(src.tolist())}
    leak = [[a, b] for a, b, *_ in exact + near if bool(is_val[pos[a]]) != bool(is_val[pos[b]])]
    return {"exact": exact, "near": near, "leakage": leak}


def outliers(x: torch.Tensor, src: torch.Tensor, k: int = 5) -> dict:
    """The OUTLIER_FRACTION of samples farthest from their k-th nearest neighbour (first principal components), with
    the arithmetic a process group shares (plait.audit.outliers): one process flags what N ranks flag."""
    return flag(kth_distances(x, k), src, min(k, len(x) - 1))


def volume_reduction(el2n: np.ndarray, src: torch.Tensor, flagged: set[int], keep: float) -> dict:
    """Keep the `keep` fraction of the source with the highest EL2N among the unflagged samples; prune the rest."""
    if not 0.0 < keep <= 1.0:
        raise DataError(f"--keep {keep} must be a fraction in (0, 1], e.g. 0.5")
    ids = src.tolist()
    order = sorted((i for i in range(len(ids)) if ids[i] not in flagged), key=lambda i: (-el2n[i], ids[i]))
    n_keep = min(len(order), int(round(keep * len(ids))))
    prune = sorted(ids[i] for i in order[n_keep:]) + sorted(flagged)
    return {"method": "EL2N |p - onehot(y)| of the out-of-fold probabilities (Paul et al. 2021): the hardest unflagged "
                      "samples are kept", "keep_fraction": keep, "kept": n_keep, "prune": sorted(prune)}


def run_audit(cfg: Config, out: Path, folds: int = 5, epochs: float = 10.0, keep: float = 0.5) -> dict:
    """Audit the configured source; write out/audit.json and out/report.html; return the report."""
    import cleanlab.filter  # lazily: only the audit needs cleanlab

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    x, y, src, is_val, names, classes = whole_source(cfg)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        probs = out_of_fold(cfg, x, y, classes, folds, epochs, Path(tmp))
    labels = y.numpy()
    ranked = cleanlab.filter.find_label_issues(labels, probs, filter_by="prune_by_noise_rate",
                                               return_indices_ranked_by="self_confidence")
    issues = {"method": "cleanlab.filter.find_label_issues (confident learning, prune_by_noise_rate) on "
                        f"{folds}-fold out-of-fold probabilities",
              "indices": [int(src[i]) for i in ranked], "given": [int(labels[i]) for i in ranked],
              "suggested": [int(probs[i].argmax()) for i in ranked],
              "self_confidence": [round(float(probs[i, labels[i]]), 4) for i in ranked]}
    if any(names):
        issues["names"] = [names[i] for i in ranked]
    dups = duplicates(x, is_val, src)
    outl = outliers(x, src)
    counts = np.bincount(labels, minlength=classes)
    balance = {"counts": counts.tolist(), "imbalance_ratio": round(float(counts.max() / max(1, counts.min())), 3),
               "remedies": "--set data.sampler=balanced (every class equally likely in each batch) or "
                           "--set data.class_weights=balanced (loss weights n / (classes * count))"}
    onehot = np.eye(classes)[labels]
    el2n = np.linalg.norm(probs - onehot, axis=1)
    accuracy = float((probs.argmax(1) == labels).mean())
    exclude = sorted(set(issues["indices"]) | {b for _, b in dups["exact"]})
    coreset = volume_reduction(el2n, src, set(exclude), keep)
    report = {
        "source": {"data.name": cfg.data.name, "data.path": cfg.data.path, "samples": len(x), "classes": classes,
                   "validation_samples": int(is_val.sum())},
        "folds": folds, "epochs": epochs, "out_of_fold_accuracy": round(accuracy, 4),
        "label_issues": issues, "duplicates": dups, "outliers": outl, "class_balance": balance,
        "el2n": {"easy_below": EASY_EL2N, "easy": int((el2n < EASY_EL2N).sum()),
                 "quantiles": [round(float(q), 4) for q in np.quantile(el2n, [0.1, 0.25, 0.5, 0.75, 0.9])]},
        "exclude": exclude,
        "volume_reduction": coreset,
    }
    if any(names):  # image folders: the file of every flagged sample
        pos = {int(v): i for i, v in enumerate(src.tolist())}
        flagged = set(issues["indices"]) | set(outl["indices"]) | {i for pair in dups["exact"] + dups["near"] for i in pair[:2]}
        report["names"] = {str(i): names[pos[i]] for i in sorted(flagged)}
    report["summary"] = [
        f"audited {len(x)} samples of {cfg.data.name} ({classes} classes) with {folds}-fold out-of-fold predictions "
        f"(accuracy {accuracy:.3f})",
        f"label issues: {len(issues['indices'])}; exact duplicates: {len(dups['exact'])}, near: {len(dups['near'])}, "
        f"train/validation leakage: {len(dups['leakage'])}; outliers: {len(outl['indices'])}",
        f"class balance: largest / smallest class = {balance['imbalance_ratio']}; easy samples (EL2N < {EASY_EL2N}): "
        f"{report['el2n']['easy']}",
        f"volume reduction: a coreset of {coreset['kept']} samples ({keep:.0%} of the source), the hardest by EL2N "
        f"among the unflagged: --set data.exclude={out / 'coreset.json'}",
        f"wrote {out / 'audit.json'} and {out / 'report.html'}; train without the {len(exclude)} flagged samples with "
        f"--set data.exclude={out / 'audit.json'}",
    ]
    (out / "audit.json").write_text(json.dumps(report, indent=1))
    (out / "coreset.json").write_text(json.dumps({"exclude": coreset["prune"], "about": coreset["method"]}, indent=1))
    (out / "report.html").write_text(_html(report, x, src, _histogram(el2n, probs[np.arange(len(labels)), labels])))
    return report


def _grid(x: torch.Tensor, src: torch.Tensor, ids: list[int], captions: list[str]) -> str:
    """A PNG (base64) of up to 16 samples, when the inputs are images."""
    if x.dim() != 4 or not ids:
        return ""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pos = {int(s): i for i, s in enumerate(src.tolist())}
    ids, captions = ids[:16], captions[:16]
    fig, axes = plt.subplots(1, len(ids), figsize=(1.2 * len(ids), 1.5), squeeze=False)
    for ax, i, cap in zip(axes[0], ids, captions):
        img = x[pos[i]]
        img = img[0] if img.shape[0] == 1 else img.permute(1, 2, 0)
        ax.imshow(img.numpy(), cmap="gray" if img.dim() == 2 else None)
        ax.set_title(cap, fontsize=7)
        ax.axis("off")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return f'<img src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def _histogram(el2n: np.ndarray, confidence: np.ndarray) -> str:
    """A PNG (base64) of the EL2N scores and the given labels' out-of-fold probabilities."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 2.5))
    axes[0].hist(el2n, bins=40)
    axes[0].set_xlabel("EL2N |p - onehot(y)|")
    axes[1].hist(confidence, bins=40)
    axes[1].set_xlabel("out-of-fold probability of the given label")
    for ax in axes:
        ax.set_ylabel("samples")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return f'<img src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def _html(r: dict, x: torch.Tensor, src: torch.Tensor, plots: str = "") -> str:
    li = r["label_issues"]
    caps = [f"#{i}: {g}->{s}" for i, g, s in zip(li["indices"], li["given"], li["suggested"])]
    rows = "".join(f"<tr><td>{i}</td><td>{html.escape(str(n))}</td><td>{g}</td><td>{s}</td><td>{c}</td></tr>"
                   for i, n, g, s, c in list(zip(li["indices"], li.get("names", [""] * len(li["indices"])), li["given"],
                                                 li["suggested"], li["self_confidence"]))[:200])
    counts = " ".join(f"{k}: {v}" for k, v in enumerate(r["class_balance"]["counts"]))
    o = r["outliers"]
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>plait data audit</title>
<style>body{{font-family:sans-serif;margin:2em}} td,th{{padding:2px 8px;text-align:left}}</style></head><body>
<h1>plait data audit</h1><p>{"<br>".join(html.escape(s) for s in r["summary"])}</p>{plots}
<h2>Label issues ({len(li["indices"])})</h2><p>{html.escape(li["method"])}</p>{_grid(x, src, li["indices"], caps)}
<table><tr><th>source index</th><th>name</th><th>given</th><th>suggested</th><th>self-confidence</th></tr>{rows}</table>
<h2>Duplicates</h2><p>exact: {html.escape(str(r["duplicates"]["exact"][:50]))}</p>
<p>near: {html.escape(str(r["duplicates"]["near"][:50]))}</p><p>leakage: {html.escape(str(r["duplicates"]["leakage"][:50]))}</p>
<h2>Outliers ({len(o["indices"])})</h2><p>{html.escape(o["method"])}</p>
{_grid(x, src, o["indices"], [f"#{i}" for i in o["indices"]])}
<h2>Class balance</h2><p>{counts}; largest / smallest = {r["class_balance"]["imbalance_ratio"]}</p>
<h2>EL2N</h2><p>{r["el2n"]["easy"]} samples below {r["el2n"]["easy_below"]}; quantiles 10/25/50/75/90 %:
{r["el2n"]["quantiles"]}</p></body></html>"""
