"""data.stream in the loop: the forgetting table and elastic weight consolidation (EWC, Kirkpatrick et al. 2017).

At the end of each task (the first step of the next, and the end of the run) every task's validation split is
evaluated alone: row i of the table is the accuracy (a regression: the loss) on each task after training task i,
and a task's forgetting is its best earlier figure minus its last (Chaudhry et al. 2018). summary.json's
`continual` holds both; the report shows the table.

With train.ewc = lambda, finishing task t also consolidates it: its Fisher information diagonal F_t, the mean over
train.ewc_samples of its training samples (the first of a permutation seeded by (seed, t)) of each sample's squared
gradient of -log p(y | x) at the weights theta*_t of that moment (the empirical Fisher), is kept with theta*_t.
Every later step adds the gradient of the penalty (lambda / 2) sum_t sum_i F_t,i (theta_i - theta*_t,i)^2, that is
lambda sum_t F_t (theta - theta*_t), to the synchronised gradient before clipping and the optimizer step. It is
elementwise, so each rank adds it to the pieces it holds (ZeRO's shards) and every layout takes one process's step.
The logged loss is the task's loss alone. F_t and theta*_t are written to RUN_DIR/continual/task<t>.safetensors
(rank 0; whole tensors, two model copies per task) and read back on resume.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor, distribute_tensor

from plait.callback import Callback
from plait.data.sampler import _epoch_seed
from plait.models import build_model
from plait.train.evaluate import evaluate


def empirical_fisher(model: nn.Module, dataset, loss_fn, samples: int, seed: int) -> dict[str, torch.Tensor]:
    """The mean over `samples` samples of `dataset` (the first of a permutation drawn from `seed`) of each sample's
    squared gradient of loss_fn, per parameter, in one process."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(len(dataset), generator=g)[:samples]
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    fisher = {n: torch.zeros_like(p) for n, p in params.items()}
    model.eval()
    for i in idx.tolist():
        x, y = dataset.fetch(torch.tensor([i]))
        grads = torch.autograd.grad(loss_fn(model(x), y), list(params.values()))
        for n, gr in zip(params, grads):
            fisher[n] += gr.detach() ** 2
    return {n: f / len(idx) for n, f in fisher.items()}


class Continual(Callback):
    name = "continual"

    def __init__(self, strategy, cfg, rt, bundle, boundaries: list[int], loss_fn, run_dir: Path | None):
        self.strategy, self.cfg, self.rt, self.bundle, self.loss_fn = strategy, cfg, rt, bundle, loss_fn
        self.boundaries, self.run_dir, self.lam = boundaries, run_dir, cfg.train.ewc
        self.rows: list[dict] = []  # {"after_task", "step", "values"}: each task's figure after a task
        self.anchors: list[tuple[dict, dict]] = []  # per consolidated task: (F_t, theta*_t), this rank's pieces
        self.metric = "val_accuracy" if bundle.spec.task in ("classification", "binary") else "val_loss"

    def on_step_begin(self, step: int) -> list[dict]:
        if step not in self.boundaries or len(self.rows) > self.boundaries.index(step):
            return []
        t = self.boundaries.index(step)  # task t is done
        row = self.table_row(t, step)
        if self.lam:
            self.consolidate(t)
        return [{"step": step, "task_done": t, f"task_{self.metric}": row["values"]}]

    def table_row(self, t: int, step: int) -> dict:
        values = [evaluate(self.strategy, val, self.cfg, self.rt, self.bundle.spec.task)[self.metric]
                  for _, val in self.bundle.tasks]  # collectives: every rank evaluates
        self.rows.append({"after_task": t, "step": step, "values": values})
        return self.rows[-1]

    def consolidate(self, t: int) -> None:
        """Keep task t's Fisher diagonal and the weights now (every rank computes the same, from the whole model)."""
        whole = self.strategy.full_model_state_dict()  # a collective when the weights are sharded
        model = build_model(self.cfg.model, self.bundle.spec)
        model.load_state_dict(whole)
        fisher = empirical_fisher(model, self.bundle.tasks[t][0], self.loss_fn, self.cfg.train.ewc_samples,
                                  _epoch_seed(self.cfg.train.seed ^ 0xF15E, t))
        anchor = {n: whole[n].float() for n in fisher}
        if self.run_dir is not None and self.rt.is_main:
            (self.run_dir / "continual").mkdir(exist_ok=True)
            save_file({**{f"fisher.{n}": f.contiguous() for n, f in fisher.items()},
                       **{f"anchor.{n}": a.contiguous() for n, a in anchor.items()}},
                      str(self.run_dir / "continual" / f"task{t}.safetensors"))
        self.anchors.append((self._local(fisher), self._local(anchor)))

    def _local(self, whole: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's pieces of whole tensors, laid out as its parameters are (ZeRO's shards)."""
        out = {}
        for n, p in self.strategy.module.named_parameters():
            if n not in whole:
                continue
            t = whole[n].to(p.device, p.dtype)
            out[n] = distribute_tensor(t, p.device_mesh, p.placements, src_data_rank=None).to_local() \
                if isinstance(p, DTensor) else t
        return out

    def after_compute(self, step: int, seconds: float, samples: int) -> None:
        """EWC: lambda sum_t F_t (theta - theta*_t) into each gradient this rank holds."""
        if not self.anchors:
            return
        with torch.no_grad():
            for n, p in self.strategy.module.named_parameters():
                if p.grad is None or n not in self.anchors[0][0]:
                    continue
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                theta = p.to_local() if isinstance(p, DTensor) else p
                for fisher, anchor in self.anchors:
                    grad.add_(self.lam * fisher[n] * (theta - anchor[n]))

    def summary(self, step: int, final: dict) -> dict:
        if not self.rows or self.rows[-1]["step"] != step:  # the end of the run (or of this session)
            self.table_row(len(self.boundaries) if step >= self.cfg.train.steps else -1, step)
        rows = self.rows
        table = [r["values"] for r in rows]
        sign = 1.0 if self.metric == "val_accuracy" else -1.0
        forgetting = []  # task j: its best figure after it was trained (before the last row) less its last
        for j in range(len(table[-1])):
            earlier = [r["values"][j] for r in rows[:-1] if r["after_task"] >= j]
            forgetting.append(max(sign * (e - table[-1][j]) for e in earlier) if earlier else None)
        return {"continual": {"tasks": len(self.bundle.tasks), "metric": self.metric, "rows": rows,
                              "forgetting": forgetting, "ewc": self.lam, "replay": self.cfg.data.replay}}

    def state_dict(self) -> dict:
        return {"rows": self.rows, "consolidated": len(self.anchors)}

    def load_state_dict(self, state: dict) -> None:
        self.rows = list(state.get("rows", []))
        self.anchors = []
        for t in range(int(state.get("consolidated", 0))):
            got = load_file(str(Path(self.run_dir or ".") / "continual" / f"task{t}.safetensors"))
            fisher = {k.removeprefix("fisher."): v for k, v in got.items() if k.startswith("fisher.")}
            anchor = {k.removeprefix("anchor."): v for k, v in got.items() if k.startswith("anchor.")}
            self.anchors.append((self._local(fisher), self._local(anchor)))
