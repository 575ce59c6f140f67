"""Memory per rank, measured from the tensors the rank actually holds (local shards, deduplicated storage).

    params_bytes            parameters at rest (DTensor shards count their local piece)
    grads_bytes             gradients right after backward (before the optimizer clears them)
    optimizer_bytes         optimizer state tensors (only the local shard under ZeRO; 0 when offloaded)
    optimizer_offloaded_bytes  optimizer state kept on disk or in host memory (parallel.offload), if any
    activations_peak_bytes  tensors saved for backward by one micro-batch's forward, at most
    peak_rss_bytes          the process's peak resident memory (CUDA: cuda_peak_bytes as well)
"""

from __future__ import annotations

import contextlib
import resource
import sys

import torch

from plait.parallel.saved import param_storages


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen: dict[tuple, int] = {}
    for t in tensors:
        if t is None:
            continue
        t = _local(t)
        if t.numel() == 0:
            continue
        if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:  # a wrapper subclass (torchao's 8-bit
            names, _ = t.__tensor_flatten__()                                 # states): the tensors it holds
            for name, n in _inner(t, names).items():
                seen[name] = max(seen.get(name, 0), n)
            continue
        st = t.untyped_storage()
        key = (t.device.type, t.device.index, st.data_ptr())
        seen[key] = max(seen.get(key, 0), st.nbytes())
    return sum(seen.values())


def _inner(t, names) -> dict[tuple, int]:
    out: dict[tuple, int] = {}
    for name in names:
        inner = getattr(t, name)
        st = inner.untyped_storage()
        out[(inner.device.type, inner.device.index, st.data_ptr())] = st.nbytes()
    return out


def params_bytes(module: torch.nn.Module) -> int:
    return storage_bytes(p for p in module.parameters())


def grads_bytes(module: torch.nn.Module) -> int:
    return storage_bytes(p.grad for p in module.parameters())


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    if getattr(optimizer, "offloaded_bytes", None) is not None:  # plait.parallel.offload: streamed a chunk at a time
        return 0
    return storage_bytes(v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))


class ActivationMeter:
    """Counts the bytes autograd saves for backward inside `measure()` (distinct storages).

    Weights saved for backward (or views of them, like a transposed matrix) are model state,
    not activations: storages of `module`'s parameters are left out.
    """

    def __init__(self, module: torch.nn.Module | None = None) -> None:
        self.peak = 0
        self.module = module
        self.totals: dict = {}

    @contextlib.contextmanager
    def measure(self, key=None, codec=None):
        """Count what is saved inside; calls with the same `key` (one micro-batch's pieces) add up. With a codec
        (plait.parallel.saved: train.activation_compression) what is saved is packed first, and that is counted."""
        seen: dict[int, int] = {}
        params = param_storages(self.module)

        def pack(t: torch.Tensor):
            if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter) or not t.numel():
                return t
            packed = codec.pack(t, params) if codec is not None else t
            for x in codec.tensors(packed) if codec is not None else (t,):
                try:
                    st = _local(x).untyped_storage()
                    if st.data_ptr() not in params:
                        seen[st.data_ptr()] = st.nbytes()
                except (RuntimeError, NotImplementedError):
                    pass
            return packed

        with torch.autograd.graph.saved_tensors_hooks(pack, codec.unpack if codec is not None else (lambda t: t)):
            yield
        total = sum(seen.values())
        if key is not None:
            total = self.totals[key] = self.totals.get(key, 0) + total
        self.peak = max(self.peak, total)


def peak_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def snapshot(module: torch.nn.Module, optimizer, grads: int, activations: int, device: torch.device) -> dict:
    out = {
        "params_bytes": params_bytes(module),
        "grads_bytes": grads,
        "optimizer_bytes": optimizer_bytes(optimizer),
        **({"optimizer_offloaded_bytes": optimizer.offloaded_bytes}
           if getattr(optimizer, "offloaded_bytes", None) is not None else {}),
        "activations_peak_bytes": activations,
        "peak_rss_bytes": peak_rss_bytes(),
    }
    if device.type == "cuda":
        out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(device)
    return out
