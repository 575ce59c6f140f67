"""Run one batch on a loaded model: the code every executor shares (server thread, replica process).

Tasks and results are the picklable dataclasses of plait.serve.executor.tasks, so the same `Runner.run`
serves in-process and behind a pipe:

    Infer(array)             -> InferOutput({output name: array})
    Generate((GenRow, ...))  -> GenerateOutput([[new token ids] or RowFailed per row])

Exact batching: CPU GEMM kernels pick their blocking (and so the order of each row's sums)
from the matrix shape and thread count, which is why a batch of 7 and a batch of 1 can differ
in the last bit (with MKL a lone row takes a matrix-vector path of its own). Two things keep a
request's answer bitwise the one it gets alone:

- `strict_blas()`, which `plait serve` calls before its first matrix product, asks MKL (on Intel CPUs) for its
  strict conditional numerical reproducibility (`MKL_CBWR=AUTO,STRICT`): each output element is
  then summed in an order that depends on neither the thread count nor the number of rows. With
  it every batch size is exact and a lone request runs as one row, unpadded. On other x86 CPUs
  with AVX2 it picks MKL's AVX2 path, whose small batches are ~2x faster than MKL's own choice.
- Whatever the BLAS, the runner probes at start-up which batch sizes give every row exactly the
  bits it gets in a batch of `pad_to` (= max_batch_size) rows, at the front and at the back of
  the batch, and pads each classifier batch with zero rows to the smallest such size. Without
  strict mode (a GEMM already ran in this process, MKL_CBWR set otherwise, another BLAS) that
  may be `pad_to` alone: answers stay exact, and a lone request pays for the padding rows.

The device (--device, plait.serve.model.device): the runner moves the model there once, each batch's
input there, and the outputs back to host numpy; generation does its own moves (kvcache.generate).
On a GPU the exact sizes are probed the same way, with the GPU's kernels.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Sequence

import numpy as np
import torch

from plait.serve.executor.generate import generate
from plait.serve.executor.tasks import (
    Cancelled,
    Emit,
    Generate,
    GenerateOutput,
    GenRow,
    Infer,
    InferOutput,
    Result,
    RowFailed,
    Task,
)
from plait.serve.model.load import DECODERS, ServedModel

STRICT_BLAS = "AUTO,STRICT"  # MKL's conditional numerical reproducibility, strict: results independent of the row count


def _cpuinfo() -> tuple[str, set[str]]:
    """(vendor_id, flags) of the first processor in Linux's /proc/cpuinfo; ("", set()) when it cannot tell."""
    vendor, flags = "", set[str]()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return vendor, flags


def intel_cpu() -> bool:
    """Whether this is an Intel processor (Linux's /proc/cpuinfo); False when it cannot tell."""
    return _cpuinfo()[0] == "GenuineIntel"


def strict_blas(exact: bool = True) -> bool:
    """Choose MKL's code path (MKL_CBWR) for serving, unless the user chose one; True when it was set here.

    - Intel, exact answers: `AUTO,STRICT`, strict reproducibility: every batch size exact, a lone request one row.
    - Another x86 processor with AVX2 (AMD), either mode: `AVX2`. MKL's automatic choice takes a slow path there for
      products of a few rows: on an AMD EPYC the 17 M-parameter MLP's 4-row forward took 8.2 ms in the default mode
      and 4.5 ms under AVX2, 16 rows 9.0-10.3 ms against 6.3-7.1, one row 4.6-4.8 ms in both
      (benchmarks/serve_exact_rows.py). Strict mode there made only the full batch exact; under AVX2 the probe
      (`exact_sizes`) finds 10-16 rows exact against 16, and a lone exact request pays for 10 rows at AVX2's speed.

    MKL reads it at its first call, so this must run before the process's first matrix product (the probe in
    `Runner.prepare` checks the effect rather than trusting it). Replica processes inherit it."""
    if "MKL_CBWR" in os.environ:
        return False
    vendor, flags = _cpuinfo()
    if vendor == "GenuineIntel":
        if not exact:
            return False
        os.environ["MKL_CBWR"] = STRICT_BLAS
    elif vendor and "avx2" in flags:
        os.environ["MKL_CBWR"] = "AVX2"
    else:
        return False
    return True


def exact_sizes(module: torch.nn.Module, input_shape: list, pad_to: int, trials: int = 2,
                device: torch.device | str = "cpu") -> list[int]:
    """Batch sizes m <= pad_to whose rows equal, bit for bit, the same rows inside a batch of pad_to (on `device`)."""
    ok = set(range(1, pad_to + 1))
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for _ in range(trials):
            x = torch.randn(pad_to, *input_shape, generator=g).to(device)
            full = module(x)
            for m in sorted(ok):
                if m == pad_to:
                    continue
                front, back = module(x[:m]), module(x[pad_to - m:])
                if not (torch.equal(front, full[:m]) and torch.equal(back, full[pad_to - m:])):
                    ok.discard(m)
    return sorted(ok)


class Runner:
    def __init__(self, served: ServedModel, pad_to: int | None = None, device: torch.device | str = "cpu"):
        self.served = served
        self.device = torch.device(device)
        if self.device.type != "cpu":  # loaded (and checked) on the host; from here on it lives on the device
            served.module.to(self.device)
        self.pad_to = pad_to if not served.is_lm else None  # lm answers are compared by tokens, not bits
        self.sizes: list[int] | None = None if self.pad_to else []

    def prepare(self) -> None:
        """Probe the exact batch sizes, on the thread (and with the thread count) that will run the batches."""
        if self.sizes is None:
            pad_to = self.pad_to
            assert pad_to is not None, "__init__ leaves sizes to probe only when there is a pad_to"
            self.sizes = exact_sizes(self.served.module, self.served.spec.input_shape, pad_to, device=self.device)

    def padded(self, n: int) -> int:
        """Rows a batch of n runs as: the smallest exact size >= n."""
        self.prepare()
        return next((m for m in self.sizes if m >= n), n)

    @torch.inference_mode()
    def infer(self, x: np.ndarray) -> dict[str, np.ndarray]:
        t = torch.from_numpy(np.ascontiguousarray(x) if x.flags.writeable else x.copy())  # frombuffer views are read-only
        n = t.shape[0]
        rows = self.padded(n) if self.pad_to else n
        if rows > n:
            t = torch.cat([t, t.new_zeros(rows - n, *t.shape[1:])])
        spread = None
        if self.served.is_ensemble:  # model.ensemble: one pass of the members gives the answer and their disagreement
            logits, spread = self.served.module.predict(t.to(self.device))
        else:
            logits = self.served.module(t.to(self.device))  # padded on the host, run on the device
        logits = logits[:n].float().cpu()
        out = {"logits": logits.numpy()}
        if not self.served.is_lm:
            out["label"] = logits.argmax(-1).numpy()
        if spread is not None:
            out["spread"] = spread[:n].float().cpu().numpy()
        return out

    def generate(self, rows: Sequence[GenRow], emit: Emit | None = None,
                 cancelled: Cancelled | None = None) -> list[list[int] | RowFailed]:
        module = self.served.module
        assert isinstance(module, DECODERS), "Service.generate sends Generate tasks only when served.can_generate"
        return generate(module, list(rows), emit, cancelled, device=self.device)

    def run(self, task: Task, emit: Emit | None = None, cancelled: Cancelled | None = None) -> Result:
        match task:
            case Infer(inputs=x):
                return InferOutput(self.infer(x))
            case Generate(rows=rows):
                return GenerateOutput(self.generate(rows, emit, cancelled))
            case _:
                raise TypeError(f"not a serving task: {type(task).__name__} (see plait.serve.executor.tasks)")


class LocalExecutor:
    """The model in the server process; batches run one at a time on a worker thread (the event loop stays free).

    An `Executor` (plait.serve.executor.tasks); the runner does the dispatch on the task's type."""

    capacity = 1
    restarts = 0

    def __init__(self, runner: Runner, threads: int | None = None):
        self.runner = runner
        # OpenMP's thread count is per thread: without this the worker thread runs with OpenMP's default
        # team (all cores) whatever the server set, and on a busy machine the spinning team stalls (4x slower).
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="plait-model",
                                                           initializer=torch.set_num_threads,
                                                           initargs=(threads or torch.get_num_threads(),))

    async def start(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._pool, self.runner.prepare)

    def ready(self) -> bool:
        return True

    async def run(self, task: Task, on_event: Emit | None = None, cancelled: Cancelled | None = None) -> Result:
        loop = asyncio.get_running_loop()
        emit: Emit | None = None
        if on_event is not None:
            def emit_on_loop(row: int, position: int, token: int) -> None:  # on the worker thread: on_event runs on the loop
                loop.call_soon_threadsafe(on_event, row, position, token)
            emit = emit_on_loop
        return await loop.run_in_executor(self._pool, self.runner.run, task, emit, cancelled)

    async def stop(self) -> None:
        self._pool.shutdown(wait=True)
