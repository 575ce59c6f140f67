"""The parity gate every edge export runs: the exported model against the eager one on held-out inputs.

Held-out inputs are the first `samples` validation samples of the run's own data (what the
training run evaluated on); when the data cannot be built here (a path that is gone, say) they are
fixed random inputs of the model's input shape, and the report says so. Accuracy and loss are
computed only where there are labels.

Bounds (an export that misses its bound is removed and the command exits 2):
  fp32 exports:      max |exported - eager| <= FP32_ATOL * max(1, max |eager|)
  --quantize int8:   validation accuracy drop <= INT8_MAX_ACCURACY_DROP (classifiers; top-1 agreement
                     when there are no labels) and loss increase <= INT8_MAX_LOSS_INCREASE
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from plait.config import load_config
from plait.data import build_data
from plait.data.datasets import eval_batches
from plait.data.spec import DataSpec
from plait.errors import PlaitError
from plait.train.loss import loss_for

FP32_ATOL = 1e-4
INT8_MAX_ACCURACY_DROP = 0.05
INT8_MIN_AGREEMENT = 0.9  # top-1 agreement with eager, when there are no labels
INT8_MAX_LOSS_INCREASE = 0.1


class ParityError(PlaitError):
    """An exported model does not compute what the eager model computes (within the gate's bound)."""


@dataclass
class HeldOut:
    x: torch.Tensor
    y: torch.Tensor | None
    source: str  # "validation" or "random"


@dataclass
class Parity:
    samples: int
    source: str
    max_abs_diff: float
    bound: float | None  # None: int8 (judged by accuracy/loss instead)
    eager_loss: float | None = None
    export_loss: float | None = None
    eager_acc: float | None = None
    export_acc: float | None = None
    agreement: float | None = None

    @property
    def ok(self) -> bool:
        if self.bound is not None:
            return self.max_abs_diff <= self.bound
        if self.eager_acc is not None and self.export_acc is not None:
            if self.eager_acc - self.export_acc > INT8_MAX_ACCURACY_DROP:
                return False
        elif self.agreement is not None and self.agreement < INT8_MIN_AGREEMENT:
            return False
        return not (self.eager_loss is not None and self.export_loss is not None
                    and self.export_loss - self.eager_loss > INT8_MAX_LOSS_INCREASE)

    def line(self) -> str:
        text = f"parity on {self.samples} {self.source} inputs: max abs diff {self.max_abs_diff:.3g}"
        if self.bound is not None:
            text += f" (bound {self.bound:.3g})"
        if self.eager_loss is not None:
            text += f", loss {self.eager_loss:.4f} -> {self.export_loss:.4f}"
        if self.eager_acc is not None:
            text += f", accuracy {self.eager_acc:.4f} -> {self.export_acc:.4f}"
        if self.agreement is not None:
            text += f", top-1 agreement {self.agreement:.4f}"
        return text


def held_out(run_dir: Path, spec: DataSpec, example: Callable[[int], torch.Tensor], samples: int = 256) -> HeldOut:
    """The run's first `samples` validation samples, else `example(samples)` (random inputs, no labels)."""
    try:
        cfg = load_config(run_dir / "config.toml", validate=False)
        bundle = build_data(cfg.data, cfg.model)
        idx = torch.cat(eval_batches(bundle.val, samples, samples))
        x, y = bundle.val.fetch(idx)
        if len(x):
            return HeldOut(x, y, "validation")
    except Exception:  # the data may be gone or unbuildable here: random inputs still compare the two models
        pass
    return HeldOut(example(samples), None, "random")


@torch.inference_mode()
def compare(eager: Callable, exported: Callable, data: HeldOut, spec: DataSpec, quantized: bool) -> Parity:
    """Run both on the held-out inputs and measure; `exported` takes and returns torch tensors."""
    a, b = eager(data.x).float(), exported(data.x).float()
    diff = float((a - b).abs().max()) if a.numel() else 0.0
    bound = None if quantized else FP32_ATOL * max(1.0, float(a.abs().max()))
    p = Parity(len(data.x), data.source, diff, bound)
    if spec.task in ("classification", "lm"):
        p.agreement = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    if data.y is not None and spec.task != "contrastive":
        loss = loss_for(spec)
        p.eager_loss, p.export_loss = float(loss(a, data.y)), float(loss(b, data.y))
        if spec.task == "classification":
            p.eager_acc = float((a.argmax(-1) == data.y).float().mean())
            p.export_acc = float((b.argmax(-1) == data.y).float().mean())
    return p
