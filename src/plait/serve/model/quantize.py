"""`--quantize int8`: int8 weights for the linear layers (torchao), and what it costs in accuracy.

The layers get torchao's int8 weight-only quantization (one fp32 scale per output row), the same path
as `plait compress --quantize int8` (plait.compress.core.int8_weight_only), so it needs no calibration
data; a head tied to the embedding stays fp32. Serving a `plait compress --quantize int8` file needs no
flag: its layers load as int8 already. The accuracy change is measured at start-up on the run's
validation data when the run directory is served, else on fixed random inputs (agreement of
the top-1 prediction with the fp32 model), and printed before the server accepts requests.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn as nn

from plait.compress.core import int8_weight_only
from plait.config import load_config
from plait.data import build_data
from plait.data.datasets import eval_batches
from plait.errors import ConfigError
from plait.extras import install_command
from plait.serve.errors import ServeError
from plait.train.loss import loss_for

QUANTIZE_CHOICES = ("int8",)


def quantize_int8(module: nn.Module) -> nn.Module:
    """A copy of `module` whose own nn.Linear layers hold int8 weights (torchao weight-only, a scale per row)."""
    q = copy.deepcopy(module)
    try:
        int8_weight_only(q)  # a tied head keeps fp32: quantizing it would change the embedding table too
    except ConfigError:
        raise ServeError(f"--quantize int8 uses torchao: {install_command('lowbit')}, or serve without --quantize") from None
    return q


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
