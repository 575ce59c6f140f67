"""`--quantize int8`: dynamic int8 quantization of the linear layers (CPU), and what it costs in accuracy.

Dynamic quantization stores Linear weights as int8 and quantizes activations on the fly, so
it needs no calibration data. The accuracy change is measured at start-up on the run's
validation data when the run directory is served, else on fixed random inputs (agreement of
the top-1 prediction with the fp32 model), and printed before the server accepts requests.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import torch
import torch.nn as nn

from plait.config import load_config
from plait.data import build_data
from plait.data.datasets import eval_batches
from plait.models.gpt import GPT
from plait.train.loss import loss_for

QUANTIZE_CHOICES = ("int8",)


def quantize_int8(module: nn.Module) -> nn.Module:
    """A copy of `module` whose nn.Linear layers run in int8 (weights per tensor, activations dynamic)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization announces its move to torchao
        from torch.ao.quantization import quantize_dynamic

        q = copy.deepcopy(module)
        if isinstance(q, GPT) and q.head is not None and q.head.weight is q.tok_emb.weight:
            # The tied head keeps fp32: quantizing it would also change the embedding table's meaning.
            head = q.head
            q.head = None
            q = quantize_dynamic(q, {nn.Linear}, dtype=torch.qint8)
            q.head = head
            return q
        return quantize_dynamic(q, {nn.Linear}, dtype=torch.qint8)


@torch.inference_mode()
def accuracy_change(fp32: nn.Module, int8: nn.Module, served, source: str) -> str:
    """One line comparing the fp32 and int8 models: validation loss/accuracy, or top-1 agreement."""
    path = Path(source)
    if path.is_dir():
        try:
            cfg = load_config(path / "config.toml", validate=False)
            bundle = build_data(cfg.data, cfg.model)
            loss_fn = loss_for(bundle.spec)
            batches = eval_batches(bundle.val, cfg.train.eval_samples, cfg.train.eval_batch_size)
            figures = []
            for m in (fp32, int8):
                loss = correct = n = 0.0
                for idx in batches:
                    x, y = bundle.val.fetch(idx)
                    logits = m(x)
                    loss += float(loss_fn(logits, y)) * len(idx)
                    if not served.is_lm:
                        correct += float((logits.argmax(-1) == y).sum())
                    n += len(idx)
                figures.append((loss / n, correct / n))
            (l32, a32), (l8, a8) = figures
            line = f"int8: validation loss {l32:.4f} -> {l8:.4f} ({l8 - l32:+.4f})"
            if not served.is_lm:
                line += f", accuracy {a32:.4f} -> {a8:.4f} ({a8 - a32:+.4f})"
            return line + f" on {int(n)} validation samples"
        except Exception as e:  # the data may be gone; fall back to random inputs
            note = f" (validation data unavailable: {e})"
    else:
        note = ""
    x = served.example_input(256)
    a, b = fp32(x), int8(x)
    agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    return (f"int8: top-1 agreement with fp32 {agree:.4f}, max |logit change| {float((a - b).abs().max()):.4f} "
            f"on {len(x)} random inputs{note}")
