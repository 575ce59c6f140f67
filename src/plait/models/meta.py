"""Build a model on the meta device, then materialise each rank's shards with a single process's initial values.

    module, record = build_on_meta(lambda: build_model(cfg.model, spec))   # no memory, no RNG drawn
    ... shard module (FSDP2's fully_shard works on meta parameters) ...
    stats = materialize(module, record, device)                             # this rank's shards only

Building on the meta device runs the model's constructor without storage, and `build_on_meta`
records every operation that initialises a parameter (uniform_, normal_, fill_, zero_, ...) and
every draw from the random generator, in order. `materialize` replays that record on the CPU from
the generator state the build started from: each parameter is generated whole, exactly as the
plain build would have generated it (the same op on the same shape after the same draws), its
local shard copied out, and the whole tensor dropped before the next one starts. Peak memory is
this rank's shards plus one whole parameter (torchtitan builds on meta and calls `init_weights`
on the shards instead, which draws different numbers than a single process would).

A parameter whose initial value depends on data (rejection sampling, a copy from another tensor,
QR for orthogonal_) cannot be replayed: the record says so (`record.supported` False, with the
reason) and the caller builds the model the ordinary way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass
class Op:
    func: object  # an aten OpOverload
    args: tuple  # scalars after the target (the target itself is args[0] of the call)
    kwargs: dict
    target: int | None  # the storage key of the tensor written, None for a factory's fresh output
    geometry: tuple | None  # (size, stride, storage_offset, dtype) of the tensor written
    random: bool  # draws from the generator
    factory: bool = False  # a fresh random tensor (torch.randn ...): `target` is its storage


@dataclass
class InitRecord:
    ops: list[Op] = field(default_factory=list)
    rng_state: torch.Tensor | None = None  # the CPU generator's state when the build started
    names: dict[int, str] = field(default_factory=dict)  # storage key -> parameter name (first of tied names)
    aliases: dict[str, list[str]] = field(default_factory=dict)  # that name -> every name of the parameter
    shapes: dict[str, tuple] = field(default_factory=dict)  # parameter name -> (shape, dtype)
    unsupported: str = ""  # why the build cannot be replayed ("" when it can)

    @property
    def supported(self) -> bool:
        return not self.unsupported


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _writes_first(func) -> bool:
    args = func._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


def _is_view(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


class _Recorder(TorchDispatchMode):
    """Logs, in order, the writes to meta tensors and every random draw of a build."""

    def __init__(self, record: InitRecord):
        super().__init__()
        self.record = record
        self.tensors: list[torch.Tensor] = []  # keeps storages alive, so that their keys stay unique

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        random = torch.Tag.nondeterministic_seeded in func.tags
        tensors = [a for a in args if isinstance(a, torch.Tensor)] + [v for v in kwargs.values()
                                                                       if isinstance(v, torch.Tensor)]
        if _writes_first(func) and tensors and tensors[0] is args[0]:
            t = args[0]
            if len(tensors) > 1 and not self.record.unsupported:
                self.record.unsupported = f"{func} writes a tensor from another tensor"
            self.tensors.append(t)
            self.record.ops.append(Op(func, args[1:], kwargs, _key(t), (tuple(t.shape), t.stride(),
                                                                        t.storage_offset(), t.dtype), random))
        elif random:
            if tensors and not self.record.unsupported:
                self.record.unsupported = f"{func} draws random numbers shaped by another tensor"
            fresh = out if isinstance(out, torch.Tensor) else None
            if fresh is not None:
                self.tensors.append(fresh)
            self.record.ops.append(Op(func, args, kwargs, None if fresh is None else _key(fresh),
                                      None if fresh is None else (tuple(fresh.shape), fresh.stride(), 0, fresh.dtype), True,
                                      True))
        elif tensors and not _is_view(func) and func not in _READS_OK:
            # Reading values (a comparison, a copy out) makes the initialisation depend on data.
            if not self.record.unsupported:
                self.record.unsupported = f"{func} reads a tensor during initialisation"
        return out


_READS_OK = {torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.lift_fresh.default,
             torch.ops.aten.empty_like.default, torch.ops.aten.clone.default}


def build_on_meta(build: Callable[[], nn.Module]) -> tuple[nn.Module, InitRecord]:
    """Call `build` on the meta device, recording how it initialises its parameters (see the module docstring)."""
    record = InitRecord(rng_state=torch.get_rng_state())
    recorder = _Recorder(record)
    saved = {name: getattr(nn.init, name) for name in _SKIP_META}
    for name in _SKIP_META:  # they return at once on a meta tensor, so no op would show what they do
        setattr(nn.init, name, _refuse(record, name, saved[name]))
    try:
        with torch.device("meta"), recorder:
            module = build()
    except Exception as e:  # noqa: BLE001 -- data-dependent code cannot run on meta tensors: build it the usual way
        record.unsupported = f"the model cannot be built on the meta device ({str(e).splitlines()[0]})"
        return None, record
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)
    for name, p in module.named_parameters(remove_duplicate=False):
        first = record.names.setdefault(_key(p), name)
        record.aliases.setdefault(first, []).append(name)
        record.shapes.setdefault(first, (tuple(p.shape), p.dtype))
    real = [name for name, p in module.named_parameters() if not p.is_meta]
    if real and not record.unsupported:  # e.g. weights loaded with assign=True: values the record does not hold
        record.unsupported = f"parameters off the meta device ({', '.join(real[:3])}), e.g. loaded weights"
    buffers = [name for name, _ in module.named_buffers()]
    if buffers and not record.unsupported:
        record.unsupported = f"the model has buffers ({', '.join(buffers[:3])}), which are computed, not drawn"
    recorder.tensors.clear()
    return module, record


# torch.nn.init functions that skip meta tensors in Python (and whose values depend on data anyway).
_SKIP_META = ("trunc_normal_", "orthogonal_", "dirac_", "sparse_")


def _refuse(record: InitRecord, name: str, fn):
    def refused(*args, **kwargs):
        if not record.unsupported:
            record.unsupported = f"torch.nn.init.{name} cannot be replayed (its values depend on data)"
        return fn(*args, **kwargs)

    return refused


def _replay(op: Op, full: torch.Tensor) -> None:
    size, stride, offset, _ = op.geometry
    op.func(full.as_strided(size, stride, offset), *op.args, **op.kwargs)


def replay(record: InitRecord, stats: dict | None = None):
    """Yield (name, whole CPU tensor) for each parameter, in the order its initialisation completes.

    The generator starts from the state the build started from and ends where the plain build would
    have left it. Writes before a parameter's last whole overwrite are replayed only for their draws.
    stats["peak_live_bytes"]: the most bytes of whole parameters held at once.
    """
    stats = {} if stats is None else stats
    stats["peak_live_bytes"] = 0
    ops = record.ops
    last, opens = {}, {}
    for i, op in enumerate(ops):
        if op.target in record.names:
            last[op.target] = i
            name = record.names[op.target]
            shape, _ = record.shapes[name]
            size, stride, offset, _ = op.geometry
            whole = offset == 0 and list(size) == list(shape) and stride == _contiguous(shape)
            if whole and (op.func in _OVERWRITES or op.factory):
                opens[op.target] = i
    torch.set_rng_state(record.rng_state)
    live: dict[int, torch.Tensor] = {}
    for i, op in enumerate(ops):
        name = record.names.get(op.target)
        if op.factory:  # a fresh random tensor: a parameter's value, or drawn for the generator's sake only
            fresh = op.func(*op.args, **{**op.kwargs, "device": "cpu"})
            if name is not None and i >= opens.get(op.target, 0):
                live[op.target] = fresh.reshape(record.shapes[name][0]).to(record.shapes[name][1])
                stats["peak_live_bytes"] = max(stats["peak_live_bytes"], _bytes(live))
                if i == last[op.target]:
                    yield name, live.pop(op.target)
            continue
        if name is None or i < opens.get(op.target, 0):
            if op.random:  # dead writes (or writes to tensors that are not parameters) still draw numbers
                size, stride, offset, dtype = op.geometry
                span = offset + sum((s - 1) * st for s, st in zip(size, stride)) + 1 if all(size) else 0
                _replay(op, torch.empty(max(span, 1), dtype=dtype))
            continue
        if op.target not in live:
            shape, dtype = record.shapes[name]
            live[op.target] = torch.zeros(shape, dtype=dtype)
            stats["peak_live_bytes"] = max(stats["peak_live_bytes"], _bytes(live))
        _replay(op, live[op.target])
        if i == last[op.target]:
            yield name, live.pop(op.target)
    for key, name in record.names.items():  # parameters no op wrote (torch.empty in the plain build: undefined)
        if key not in last:
            shape, dtype = record.shapes[name]
            yield name, torch.zeros(shape, dtype=dtype)


def _bytes(live: dict) -> int:
    return sum(t.numel() * t.element_size() for t in live.values())


def _contiguous(shape) -> tuple:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


_OVERWRITES = {torch.ops.aten.uniform_.default, torch.ops.aten.normal_.default, torch.ops.aten.fill_.Scalar,
               torch.ops.aten.zero_.default, torch.ops.aten.random_.default, getattr(torch.ops.aten.random_, "from"),
               torch.ops.aten.random_.to, torch.ops.aten.bernoulli_.float, torch.ops.aten.exponential_.default}


def local_index(p: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """(the tensor holding this rank's part of parameter p, where that part lies in the whole parameter)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return p.data, tuple(slice(0, s) for s in p.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return p.to_local(), tuple(slice(o, o + s) for o, s in zip(offset, shape))


def _allocate(module: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """Storage on `device` for module's meta parameters, tied ones tied again; {name: parameter}."""
    slots: dict[int, list] = {}  # parameter object -> every (module, attribute) holding it (tied weights)
    for m in module.modules():
        for attr, p in m._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((m, attr))
    module.to_empty(device=device)  # gives each slot a tensor of its own: tie them again
    for held in slots.values():
        first = getattr(*held[0])
        for m, attr in held[1:]:
            setattr(m, attr, first)
    return dict(module.named_parameters())


def _nbytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size()


@torch.no_grad()
def materialize(module: nn.Module, source, device: torch.device) -> dict:
    """Allocate module's (possibly sharded) meta parameters on `device` and fill this rank's parts from `source`:
    an InitRecord (the single-process initial values, replayed) or {name: Lazy} (a checkpoint, each part read from
    its file, plait.models.lazy).

    `module` may hold only some of the parameters (a pipeline stage: a tied weight's other name counts).

    Returns {"full_bytes": the whole model's parameter bytes, "local_bytes": this rank's,
    "peak_bytes": the most parameter bytes this process held at once while materialising}, and from a checkpoint
    "rss_before_bytes" / "peak_rss_bytes": the process's resident memory before and at its highest during the load
    (Linux; absent elsewhere).
    """
    if not isinstance(source, InitRecord):
        return _load_parts(module, source, device)
    params = _allocate(module, device)
    local = sum(_nbytes(p) for p in params.values())
    full_bytes = sum(torch.Size(s).numel() * torch.empty(0, dtype=d).element_size() for s, d in source.shapes.values())
    stats: dict = {}
    for name, full in replay(source, stats):
        for alias in source.aliases[name]:
            if alias in params:
                target, index = local_index(params[alias])
                target.copy_(full[index])
        del full
    return {"full_bytes": full_bytes, "local_bytes": local, "peak_bytes": local + stats["peak_live_bytes"]}


def _load_parts(module: nn.Module, source: dict, device: torch.device) -> dict:
    rss = _peak_rss_reset()
    params = _allocate(module, device)
    local = sum(_nbytes(p) for p in params.values())
    full_bytes = sum(t.nbytes for t in {id(t): t for t in source.values()}.values())  # a tied tensor once
    in_flight = 0
    for name, p in params.items():
        target, index = local_index(p)
        part = source[name].read(index)
        in_flight = max(in_flight, part.numel() * part.element_size())
        target.copy_(part)
        del part
    out = {"full_bytes": full_bytes, "local_bytes": local, "peak_bytes": local + in_flight}
    if rss is not None:
        out.update({"rss_before_bytes": rss, "peak_rss_bytes": _status_bytes("VmHWM")})
    return out


def _status_bytes(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _peak_rss_reset() -> int | None:
    """Hand freed heap back to the system (glibc's malloc_trim: memory freed earlier would otherwise be reused
    unseen), then reset the kernel's high-water mark of this process's resident memory to its current value (Linux
    /proc/self/clear_refs); that value, or None where it cannot be reset."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_bytes("VmRSS")
    except (OSError, KeyError):
        return None
