"""plait's own CPU kernels for the engine: paged decode attention and flash attention for prompt chunks
(attention.cpp beside this module), and the model's linears on oneDNN-packed weights (`pack_linears`, at the end of
this module).

On by default on a CPU with float32 pools; PLAIT_KERNELS=off keeps the plain-torch attention. In-process the decode
kernel makes a decode step 1.6x faster (96 sequences at ~330 keys: 72 -> 45 ms) and a 64-request burst 1.3x; behind
`plait serve` the benchmark's overloaded mixed work runs 1.3x the tokens/s with it (397-407 -> 513-531, back to
back), once the kernel stopped resetting the engine thread's torch thread count (see attention.cpp: with ATen's
parallel_for the whole engine ran on one thread behind the server, which is why an earlier version gained nothing
there). The flash kernel attends prompt chunks in place of SDPA's CPU flash attention (docs/serving.md).

Compiled once per machine, source, flags and torch with torch's cpp_extension (a C++ compiler and ninja; about
30 s on two cores the first time, a fraction of a second to load after), into $PLAIT_KERNELS_DIR or
~/.cache/plait/kernels/<hash>. Where it cannot be built (no compiler), the engine keeps its plain-torch attention
(`why_not()` says why).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

SOURCE = Path(__file__).with_name("attention.cpp")
_lock = threading.Lock()
_loaded: dict[str, types.ModuleType | None] = {}
_why_not: dict[str, str] = {}
OFF = "PLAIT_KERNELS is off"
FLASH_HEAD_DIMS = (32, 64, 128)  # the head widths flash_attention is compiled for


def wanted() -> bool:
    """False when PLAIT_KERNELS is off (or 0, false, no): the engine then uses its plain-torch attention."""
    return os.environ.get("PLAIT_KERNELS", "on").strip().lower() not in ("off", "0", "false", "no")


# -fopenmp: the kernels' loops are OpenMP ones (their GOMP calls resolve to the OpenMP runtime torch loaded; the
# extension links no second one)
FLAGS = ["-O3", "-march=native", "-fopenmp"]


def build_dir() -> Path:
    """Where the kernels of this source, these flags and this torch are built (a new build when any changes)."""
    key = SOURCE.read_bytes() + repr((FLAGS, torch.__version__)).encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    root = os.environ.get("PLAIT_KERNELS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "plait", "kernels")
    return Path(root) / f"attention_{digest}"


def paged_decode(build: bool = True, say: Callable[[str], None] | None = None) -> Callable | None:
    """The compiled `paged_decode(q, k_pool, v_pool, tables, first, stop, block_size, scale)`, or None when it is
    off, not built yet and `build` is False, or cannot be built (`why_not()` then says why). The first build prints
    one line through `say` (stderr by default)."""
    module = _module(build, say)
    return None if module is None else module.paged_decode


# The vector width (floats) from which the flash kernel is used: on a 2-core AMD EPYC its AVX-512 build attends a
# causal 2048-token chunk of 4 heads of 64 in 6.1 ms against SDPA's 14.0 (2.3x); built for AVX2 on the same machine,
# 15.6 ms (0.9x): with 16 vector registers its tiles are too small to beat MKL's sgemm blocks.
FLASH_MIN_VECTOR = 16


def flash_attention(build: bool = True, say: Callable[[str], None] | None = None, *,
                    any_machine: bool = False) -> Callable | None:
    """The compiled `flash_attention(q, k, v, causal, scale) -> (out, lse)` (attention.cpp), or None as
    `paged_decode`, and on a machine without AVX-512 (unless `any_machine`: the tests check it anywhere)."""
    module = _module(build, say)
    if module is None:
        return None
    if not any_machine and module.vector_width() < FLASH_MIN_VECTOR:
        _why_not["flash_attention"] = (f"built for {module.vector_width()}-float vectors, where SDPA's is as fast "
                                       f"(it is used from {FLASH_MIN_VECTOR}: AVX-512)")
        return None
    _why_not.pop("flash_attention", None)
    return module.flash_attention


def _module(build: bool, say: Callable[[str], None] | None) -> types.ModuleType | None:
    if not wanted():
        _why_not["attention"] = OFF
        return None
    if _why_not.get("attention") == OFF:  # on again (a test turned it off before)
        del _why_not["attention"]
    with _lock:
        if "attention" in _loaded:
            return _loaded["attention"]
        where = build_dir()
        built = where.exists() and any(where.glob("*.so"))
        if not built and not build:
            return None
        if not built:
            (say or (lambda m: print(m, file=sys.stderr, flush=True)))(
                f"plait: compiling the attention kernels for this machine, once (about 30 s; cached in {where})")
        try:
            from torch.utils import cpp_extension

            where.mkdir(parents=True, exist_ok=True)
            # compiled from a copy in the build dir: ninja's rules name the source by path, so a checkout elsewhere
            # (another clone, a wheel's site-packages) of the same source reuses the build instead of redoing it
            source = where / SOURCE.name
            if not source.exists() or source.read_bytes() != SOURCE.read_bytes():
                source.write_bytes(SOURCE.read_bytes())
            module = _built(where) if built else cpp_extension.load(
                name=where.name, sources=[str(source)], build_directory=str(where), extra_cflags=FLAGS, verbose=False)
            _loaded["attention"] = module
        except Exception as e:  # no compiler, no ninja, a failed build: the plain-torch path, said once
            _loaded["attention"] = None
            _why_not["attention"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}"
        return _loaded["attention"]


def _built(where: Path):
    """The module built in `where` before, imported as it is: cpp_extension.load would build it again whenever its
    compiler arguments differ, and they name torch's include folder, which is another one in each venv (a fresh
    clone's suite rebuilt it, 30 s, though the key already holds the source, the flags and torch's version)."""
    import importlib.util

    so = max(where.glob("*.so"), key=lambda f: f.stat().st_mtime)
    spec = importlib.util.spec_from_file_location(so.stem, so)
    assert spec is not None and spec.loader is not None, so
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def why_not(kernel: str = "attention") -> str | None:
    """Why the kernels are None (both: off, not built); why_not("flash_attention") also says why that one alone is."""
    return _why_not.get("attention") or (_why_not.get(kernel) if kernel != "attention" else None)


# ---------------------------------------------------------------------------------------------------------------------
# Linear layers through oneDNN on packed weights (the engine's forward only)

# Rows (tokens of a step) from which oneDNN's matmul on a weight packed once for it beats F.linear (MKL's sgemm) on a
# 2-core CPU. On an Intel-flavoured AVX2 host: 0.63-0.75x the time at 4-64 rows (a 2304 x 768 weight at 4 rows
# 288 -> 217 us, 8192 x 768 993 -> 596), 1.4-1.9x at 1-2 rows, the same from 512. On an AVX-512 AMD EPYC, where MKL
# takes its AVX2 path and oneDNN its AVX-512 one: 0.16-0.62x at 4 rows, 0.39-0.52x from 64 to 2,048 rows (about 490
# against 210 GFLOP/s: a prompt's chunk too). At fewer rows it depends on the machine and the layer (one row: 1.4-1.9x
# on the first, 0.46-0.66x for the 100 M model's large layers and 1.6-2.1x for the 10 M model's small ones on the
# second; docs/benchmarks.md, "The 100 M table"), so each layer's shape is timed once at one row when it is packed.
PACKED_MIN_ROWS = 4
_engine_forward = threading.local()  # .on while this thread runs an engine's forward
# each packed layer's packed weight and the fewest rows it is used at, beside the layer (not on it: a deepcopy of the
# model cannot copy an opaque oneDNN tensor, and the copy is a plain nn.Linear again)
_PACKED: weakref.WeakKeyDictionary[nn.Module, tuple[torch.Tensor, int]] = weakref.WeakKeyDictionary()
_ONE_ROW: dict[tuple, bool] = {}  # (out, in, bias, threads): the packed matmul is faster at one row on this machine


def pack_linears(model: nn.Module) -> int:
    """Give each float32 CPU nn.Linear of `model` a copy of its weight packed for oneDNN's matmul, used by the
    engine's forward (`packed_forward()`) from PACKED_MIN_ROWS rows, and from one row where timing the layer's shape
    once says it is faster there; anywhere else the layer is F.linear as before. Returns how many layers have one (0
    when PLAIT_KERNELS is off or this torch has no oneDNN). A second copy of the weights in memory; float32 sums in
    another order (within 2e-4 of F.linear on the 100 M model's shapes)."""
    if not wanted() or not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return 0
    packed = 0
    for layer in model.modules():
        w = getattr(layer, "weight", None)
        if type(layer) is not nn.Linear or w is None or type(w.data) is not torch.Tensor:  # DTensor, quantized: as is
            continue
        if w.device.type != "cpu" or w.dtype != torch.float32:
            continue
        if layer not in _PACKED:
            with torch.no_grad():
                weight = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 4)
                _PACKED[layer] = (weight, 1 if one_row_packed(layer, weight) else PACKED_MIN_ROWS)
            layer.forward = types.MethodType(_linear, layer)
        packed += 1
    return packed


def one_row_packed(layer: nn.Linear, weight: torch.Tensor) -> bool:
    """Whether the packed matmul of one row through `layer` takes under 0.9x F.linear's time on this machine, at this
    thread's torch threads: the best of 9 calls each, the two taking turns after 3 each to warm up, timed once per
    shape (about 10 ms for the 100 M model's 4)."""
    key = (layer.out_features, layer.in_features, layer.bias is not None, torch.get_num_threads())
    if key not in _ONE_ROW:
        x = torch.randn(1, layer.in_features)
        calls = (lambda: F.linear(x, layer.weight, layer.bias), lambda: packed_matmul(x, weight, layer.bias))
        best = [math.inf, math.inf]
        for turn in range(24):
            t = time.perf_counter()
            calls[turn % 2]()
            if turn >= 6:
                best[turn % 2] = min(best[turn % 2], time.perf_counter() - t)
        _ONE_ROW[key] = best[1] < 0.9 * best[0]
    return _ONE_ROW[key]


@contextlib.contextmanager
def packed_forward() -> Iterator[None]:
    """The packed weights in use on this thread inside (the engine's forward)."""
    _engine_forward.on = True
    try:
        yield
    finally:
        _engine_forward.on = False


def _linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if getattr(_engine_forward, "on", False):
        packed = _PACKED.get(self)
        if packed is not None and x.numel() // x.shape[-1] >= packed[1]:
            return packed_matmul(x.contiguous(), packed[0], self.bias)
    return F.linear(x, self.weight, self.bias)


def packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
