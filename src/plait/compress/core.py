"""Compression after training: truncated-SVD factorisation of Linear layers, or int8 weight-only (torchao).

Both read a run's latest checkpoint (LoRA adapters merged), write one safetensors file that `plait serve`
and `load_exported` take (its metadata says how to rebuild the layers), and measure what changed: the
parameter count, the Linear layers' FLOPs (or weight bytes) per token, and the validation loss, before
and after, computed as the trainer computes it (the run's fixed validation batches).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn as nn

from plait.data import build_data
from plait.data.datasets import eval_batches
from plait.errors import ConfigError
from plait.extras import install_command
from plait.files import publish
from plait.finetune.lowrank import energy_rank, factorise
from plait.train.loss import loss_for
from plait.train.weights import load_run_model


def val_loss(model: nn.Module, cfg, bundle) -> float:
    """Validation loss of a plain model in one process: the run's fixed batches, weighted by their sizes."""
    loss_fn = loss_for(bundle.spec)
    model.eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for idx in eval_batches(bundle.val, cfg.train.eval_samples, cfg.train.eval_batch_size):
            x, y = bundle.val.fetch(idx)
            total += float(loss_fn(model(x), y).double()) * len(idx)
            n += len(idx)
    return total / n


def own_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Linear layers whose weight is their own (a head tied to the embedding is left alone)."""
    owners: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        owners[id(p)] = owners.get(id(p), 0) + 1
    return {n: m for n, m in model.named_modules() if type(m) is nn.Linear and owners[id(m.weight)] == 1}


def int8_weight_only(model: nn.Module, layers: list[str] | None = None) -> list[str]:
    """Quantize Linear layers in place to torchao's int8 weight-only (one scale per output row); returns their names.

    layers: the names to quantize (default: every own Linear whose weight is still a plain float tensor, so a
    head tied to the embedding and layers already quantized are left alone). The one int8 path of plait:
    `plait compress --quantize int8` and `plait serve --quantize int8` both go through it.
    """
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError:
        raise ConfigError(f"int8 quantization uses torchao: {install_command('lowbit')}") from None
    if layers is None:
        layers = [n for n, m in own_linears(model).items() if type(m.weight) in (torch.Tensor, nn.Parameter)]
    wanted = set(layers)
    if wanted:
        quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: fqn in wanted)
    return layers


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _meta(run_dir: Path, cfg, spec) -> dict:
    meta = {"format": "pt", "plait.model": json.dumps(dataclasses.asdict(cfg.model)),
            "plait.spec": json.dumps(dataclasses.asdict(spec))}
    tok = run_dir / "tokenizer.json"
    if tok.is_file():
        meta["plait.tokenizer"] = tok.read_text()
    return meta


def _save(tensors: dict, out: Path, meta: dict) -> None:
    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}, str(tmp), metadata=meta)
    publish(tmp, out)


def _table(rows: list[tuple[str, str, str]]) -> str:
    w = max(len(r[0]) for r in rows)
    return "\n".join(f"{a:<{w}}  {b:>14}  {c:>14}" for a, b, c in rows)


def choose_ranks(model: nn.Module, rank: int | None, energy: float | None) -> dict[str, int]:
    """Per Linear layer: the rank asked for (or the energy's), kept only where two factors are smaller than W."""
    ranks = {}
    for name, layer in own_linears(model).items():
        n_out, n_in = layer.weight.shape
        r = rank if rank is not None else energy_rank(layer.weight, energy)
        r = min(r, n_out, n_in)
        if r * (n_in + n_out) < n_in * n_out:
            ranks[name] = r
    return ranks


def compress_low_rank(run_dir: str | Path, out: str | Path, rank: int | None = None, energy: float | None = None) -> dict:
    run_dir, out = Path(run_dir), Path(out)
    cfg, spec, model = load_run_model(run_dir)
    bundle = build_data(cfg.data, cfg.model)
    ranks = choose_ranks(model, rank, energy)
    if not ranks:
        raise ConfigError(f"no Linear layer of {run_dir} gets smaller at this rank; choose a smaller --low-rank "
                          "or --low-rank-energy")
    flops_before = sum(2 * m.in_features * m.out_features for m in own_linears(model).values())
    before = {"params": _params(model), "linear_flops_per_token": flops_before, "val_loss": val_loss(model, cfg, bundle)}
    factorise(model, ranks)
    # a factorised layer's two factors are Linear layers too: 2 r (in + out) FLOPs per token against 2 in out
    flops_after = sum(2 * m.in_features * m.out_features for m in own_linears(model).values())
    after = {"params": _params(model), "linear_flops_per_token": flops_after, "val_loss": val_loss(model, cfg, bundle)}
    meta = _meta(run_dir, cfg, spec)
    meta["plait.low_rank"] = json.dumps(ranks)
    _save(model.state_dict(), out, meta)
    rows = [("", "before", "after"),
            ("parameters", f"{before['params']:,}", f"{after['params']:,}"),
            ("Linear FLOPs / token", f"{before['linear_flops_per_token']:,}", f"{after['linear_flops_per_token']:,}"),
            ("validation loss", f"{before['val_loss']:.4f}", f"{after['val_loss']:.4f}"),
            ("layers factorised", "", f"{len(ranks)} (ranks {min(ranks.values())}-{max(ranks.values())})")]
    return {"before": before, "after": after, "ranks": ranks, "table": _table(rows)}


def compress_int8(run_dir: str | Path, out: str | Path) -> dict:
    """int8 weight-only through torchao (per-row symmetric scales); the file holds the int8 weights and scales."""
    try:
        import torchao.quantization  # noqa: F401
    except ImportError:
        raise ConfigError(f"plait compress --quantize int8 uses torchao: {install_command('lowbit')}") from None
    run_dir, out = Path(run_dir), Path(out)
    cfg, spec, model = load_run_model(run_dir)
    bundle = build_data(cfg.data, cfg.model)
    layers = list(own_linears(model))
    bytes_before = sum(m.weight.numel() * m.weight.element_size() for m in own_linears(model).values())
    before = {"params": _params(model), "linear_weight_bytes": bytes_before, "val_loss": val_loss(model, cfg, bundle)}
    int8_weight_only(model, layers)
    tensors, bytes_after = {}, 0
    for name, t in model.state_dict().items():
        layer = name.removesuffix(".weight")
        if name.endswith(".weight") and layer in layers:
            tensors[name] = t.qdata
            tensors[f"{layer}.weight_scale"] = t.scale.float()
            bytes_after += t.qdata.numel() + t.scale.numel() * 4
        else:
            tensors[name] = t
    after = {"params": before["params"], "linear_weight_bytes": bytes_after, "val_loss": val_loss(model, cfg, bundle)}
    meta = _meta(run_dir, cfg, spec)
    meta["plait.quantize"] = json.dumps({"scheme": "int8-weight-only", "layers": layers})
    _save(tensors, out, meta)
    rows = [("", "before", "after"),
            ("Linear weight bytes", f"{bytes_before:,}", f"{bytes_after:,}"),
            ("validation loss", f"{before['val_loss']:.4f}", f"{after['val_loss']:.4f}"),
            ("layers quantized", "", str(len(layers)))]
    return {"before": before, "after": after, "table": _table(rows)}
