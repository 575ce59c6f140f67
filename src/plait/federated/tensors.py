"""Model weights as plain data: name -> tensor dicts, flat vectors, and the bytes that travel.

Only floating-point entries of a state dict are federated (integer buffers such as counters
stay local). On the wire a message is a safetensors blob whose metadata holds a JSON object,
so one HTTP body carries both the tensors and the plain data that goes with them, and a
hostile body can at worst fail to parse (safetensors never unpickles).
"""

from __future__ import annotations

import json
import math
import struct

import torch
import torch.nn as nn

Weights = dict[str, torch.Tensor]


def get_weights(model: nn.Module) -> Weights:
    """The model's floating-point state, detached copies on CPU in state-dict order."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items() if v.is_floating_point()}


def set_weights(model: nn.Module, weights: Weights) -> None:
    """Load federated weights into the model (other state untouched)."""
    state = model.state_dict()
    with torch.no_grad():
        for k, v in weights.items():
            state[k].copy_(v)


def shapes(weights: Weights) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in weights.items()}


def flatten(weights: Weights) -> torch.Tensor:
    """One float64 vector, in the dict's order (the model's state-dict order everywhere in plait)."""
    if not weights:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat([v.reshape(-1).to(torch.float64) for v in weights.values()])


def unflatten(vec: torch.Tensor, template: Weights) -> Weights:
    """Cut a flat vector back into tensors shaped (and typed) like `template`."""
    out, i = {}, 0
    for k, v in template.items():
        n = v.numel()
        out[k] = vec[i:i + n].reshape(v.shape).to(v.dtype)
        i += n
    if i != vec.numel():
        raise ValueError(f"vector of {vec.numel()} values does not match the model's {i}")
    return out


def norm(weights: Weights) -> float:
    """The global L2 norm of all the tensors together (in float64)."""
    return float(flatten(weights).norm())


def clip(delta: Weights, max_norm: float) -> tuple[Weights, bool]:
    """Scale the update down to global L2 norm max_norm when it is larger; returns it and whether it was clipped."""
    n = norm(delta)
    # A non-finite norm cannot be scaled to a bound; such an update is rejected or fails the aggregate's check instead.
    if not math.isfinite(n) or n <= max_norm:
        return delta, False
    s = max_norm / n
    return {k: v * s for k, v in delta.items()}, True


def encode(tensors: Weights, meta: dict | None = None) -> bytes:
    """A safetensors blob carrying `meta` (JSON) in its metadata."""
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in tensors.items()}, metadata={"plait": json.dumps(meta or {})})


def decode(blob: bytes) -> tuple[Weights, dict]:
    """Inverse of encode; raises ValueError on anything that is not such a blob."""
    from safetensors.torch import load

    try:
        if len(blob) < 8:
            raise ValueError("too short")
        (n,) = struct.unpack("<Q", blob[:8])
        if n > len(blob) - 8:
            raise ValueError("header longer than the body")
        header = json.loads(blob[8:8 + n])
        meta = json.loads(header.get("__metadata__", {}).get("plait", "{}"))
        if not isinstance(meta, dict):
            raise ValueError("metadata is not an object")
        return load(blob), meta
    except ValueError:
        raise
    except Exception as e:  # safetensors raises its own error types on corrupt input
        raise ValueError(f"not a tensor message: {e}") from None
