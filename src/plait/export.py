"""Export a run to one consolidated model.safetensors with the plain model's parameter names.

The metadata carries what it takes to rebuild the model (`plait.model`, `plait.spec`,
and `plait.tokenizer` for text models), so `load_exported` needs nothing else.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch.nn as nn

from plait.config import ModelConfig, load_config
from plait.data.spec import DataSpec
from plait.errors import CheckpointError
from plait.models import build_model
from plait.train.checkpoint import latest_checkpoint, load_model_weights


def rebuild_model(run_dir: Path):
    """The run's config and a freshly built (untrained) plain model."""
    cfg = load_config(run_dir / "config.toml", validate=False)
    spec_file = run_dir / "spec.json"
    if not spec_file.is_file():
        raise CheckpointError(f"{spec_file} is missing; is {run_dir} a plait run directory?")
    spec = DataSpec(**json.loads(spec_file.read_text()))
    return cfg, spec, build_model(cfg.model, spec)


def export(run_dir: str | Path, out: str | Path | None = None, checkpoint: str | Path | None = None) -> Path:
    """Write the latest (or the given) checkpoint's weights as safetensors; returns the file written."""
    from safetensors.torch import save_file

    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").is_file():
        raise CheckpointError(f"{run_dir} is not a plait run directory (no config.toml); pass the --out of a run")
    ckpt = Path(checkpoint) if checkpoint else latest_checkpoint(run_dir)
    if ckpt is None:
        raise CheckpointError(f"{run_dir} has no checkpoint yet; train it first (checkpoints/latest is missing)")
    cfg, spec, model = rebuild_model(run_dir)
    load_model_weights(model, ckpt)
    # Tied weights share storage; safetensors wants each name to own its tensor.
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}
    meta = {
        "format": "pt",
        "plait.model": json.dumps(dataclasses.asdict(cfg.model)),
        "plait.spec": json.dumps(dataclasses.asdict(spec)),
        "plait.checkpoint": ckpt.name,
    }
    tok = run_dir / "tokenizer.json"
    if tok.is_file():
        meta["plait.tokenizer"] = tok.read_text()
    out = Path(out) if out else run_dir / "model.safetensors"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(out)
    return out


def load_exported(path: str | Path) -> tuple[nn.Module, dict]:
    """Rebuild the model from an exported file's metadata and load its weights; returns (model, metadata)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if "plait.model" not in meta:
        raise CheckpointError(f"{path} has no plait metadata; export it with `plait export RUN_DIR`")
    model_cfg = ModelConfig(**json.loads(meta["plait.model"]))
    spec = DataSpec(**json.loads(meta["plait.spec"]))
    model = build_model(model_cfg, spec)
    model.load_state_dict(load_file(str(path)))
    return model, meta


__all__ = ["export", "load_exported", "rebuild_model"]
