"""train.activation_compression: what autograd saves for backward, stored in bf16 or int8 (DLS ch. 4).

The forward's saved activations are most of a training step's memory beyond the model states. Through
torch.autograd.graph.saved_tensors_hooks each floating-point tensor saved for backward is packed when it is saved
and unpacked when backward uses it:

- "bf16": cast to bfloat16 (half the bytes of fp32; a bf16-autocast run's bf16 tensors are kept as they are);
- "int8": int8 with one scale per row of the last dimension (absmax / 127), about a quarter of fp32's bytes
  (ActNN, Chen et al. 2021, and GACT compress the same tensors, with more care about where the error goes).

Backward then computes with the decompressed tensors: the gradients are approximate, the weights' are not
touched (parameters and views of them are saved as they are), nor integer tensors (indices). The activation meter
(plait.train.memory) counts the packed bytes, so the report's activation memory is what is held.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn

CHOICES = ("none", "bf16", "int8")


@dataclass
class Packed:
    data: torch.Tensor  # bf16, or int8
    dtype: torch.dtype  # what backward gets back
    scale: torch.Tensor | None = None  # int8: per row of the last dimension


def param_storages(module: nn.Module | None) -> set[int]:
    """Data pointers of the module's parameters' storages (a weight saved for backward is model state)."""
    out = set()
    for p in module.parameters() if module is not None else ():
        try:
            out.add((p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            pass
    return out


class SavedCodec:
    """Packs and unpacks saved tensors; `hooks(module)` installs it for one forward."""

    def __init__(self, kind: str):
        assert kind in CHOICES[1:], kind
        self.kind = kind

    def compressible(self, t: torch.Tensor, params: set[int]) -> bool:
        if type(t) is not torch.Tensor or not t.is_floating_point() or t.numel() < 2:
            return False  # a tensor subclass (DTensor, a quantized weight), indices, a scalar
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return False
        if self.kind == "bf16" and t.dtype in (torch.bfloat16, torch.float16):
            return False
        try:
            return t.untyped_storage().data_ptr() not in params
        except (RuntimeError, NotImplementedError):
            return False

    def pack(self, t: torch.Tensor, params: set[int]):
        if not self.compressible(t, params):
            return t
        if self.kind == "bf16":
            return Packed(t.detach().to(torch.bfloat16), t.dtype)
        x = t.detach().float()
        scale = (x.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
        return Packed(torch.round(x / scale).clamp_(-127, 127).to(torch.int8), t.dtype, scale)

    @staticmethod
    def unpack(obj):
        if not isinstance(obj, Packed):
            return obj
        if obj.scale is None:
            return obj.data.to(obj.dtype)
        return (obj.data.float() * obj.scale).to(obj.dtype)

    @staticmethod
    def tensors(obj) -> list[torch.Tensor]:
        """The tensors an object from pack holds (what the activation meter counts)."""
        if isinstance(obj, Packed):
            return [obj.data] + ([obj.scale] if obj.scale is not None else [])
        return [obj]

    @contextlib.contextmanager
    def hooks(self, module: nn.Module | None):
        params = param_storages(module)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self.pack(t, params), self.unpack):
            yield


def codec_for(kind: str) -> SavedCodec | None:
    return None if kind == "none" else SavedCodec(kind)


def saved_tensors(meter, codec: SavedCodec | None, module: nn.Module | None, key=None):
    """The context a forward runs in: the activation meter's (which applies the codec and counts what it packs), the
    codec's alone, or nothing."""
    if meter is not None:
        return meter.measure(key, codec)
    if codec is not None:
        return codec.hooks(module)
    return contextlib.nullcontext()
