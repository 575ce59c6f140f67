"""Optimizer state kept out of the compute device's memory and streamed through it one chunk at a time.

    parallel.offload = "disk"       optimizer state in memory-mapped files under RUN_DIR/offload/rank-R/
                                    (ZeRO-Infinity's NVMe offload, Rajbhandari et al. 2021); any device
    parallel.offload = "optimizer"  optimizer state in host memory, parameters and gradients stay on the GPU
                                    (ZeRO-Offload's split, Ren et al. 2021); no effect on a CPU run
    parallel.offload = "params"     FSDP2's CPUOffloadPolicy (plait.parallel.fsdp): sharded parameters,
                                    gradients and optimizer state in host memory, the step on the CPU; zero 2/3

`offload_optimizer(optimizer, store)` wraps an elementwise torch optimizer (AdamW, SGD). Every
parameter is cut into pieces of at most `chunk_numel` elements; each chunk gets its own instance of
the optimizer's class over views of those pieces, so the update is the optimizer's own code on
slices (elementwise: the same numbers as one step over whole tensors). A step walks the chunks:
the chunk's state is paged in (disk) or copied to the device (host memory), updated, and released
(`madvise(MADV_DONTNEED)` drops the file pages from the process), so one chunk is resident at a time.

Checkpoints see an ordinary optimizer: `state` maps each parameter to {"step", "exp_avg", ...} whose
tensors are views of the store, so DCP writes them (paging them in for the save) and a checkpoint
loads at any other offload setting and the other way round.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from plait.parallel.scheme import Build

CHUNK_NUMEL = 1 << 20  # elements per chunk: 4 MiB of fp32 per state tensor


class DiskStore:
    """Byte regions of files (one per state key), memory-mapped; a region is a tensor view of the file."""

    kind = "disk"

    def __init__(self, directory: Path, remove_dir: bool = False):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.maps: dict[str, mmap.mmap] = {}
        self.sizes: dict[str, int] = {}
        self._paths: list[Path] = []  # removed at exit (the checkpoint, not these files, holds the state)
        weakref.finalize(self, _remove, self._paths, self.directory if remove_dir else None)

    def allocate(self, key: str, layout: list[tuple[int, int, torch.dtype]], total: int) -> list[torch.Tensor]:
        """A file of `total` zero bytes for `key`; one flat tensor view per (byte offset, numel, dtype) of layout."""
        path = self.directory / f"{key}.bin"
        with open(path, "w+b") as f:
            f.truncate(max(total, 1))
            mm = mmap.mmap(f.fileno(), max(total, 1))
        self.maps[key], self.sizes[key] = mm, max(total, 1)
        self._paths.append(path)
        return [torch.frombuffer(mm, dtype=dtype, count=n, offset=off) if n else torch.empty(0, dtype=dtype)
                for off, n, dtype in layout]

    def release(self, key: str, lo: int, hi: int) -> None:
        """Drop the pages of bytes [lo, hi) from this process (their contents stay in the file's page cache)."""
        page = mmap.PAGESIZE
        start = lo // page * page
        end = min(self.sizes[key], -(-hi // page) * page)
        if end > start:
            self.maps[key].madvise(mmap.MADV_DONTNEED, start, end - start)

    def release_all(self) -> None:
        for key in self.maps:
            self.release(key, 0, self.sizes[key])


class HostStore:
    """Host-memory regions (pinned when a GPU is there to copy from them)."""

    kind = "host"

    def __init__(self, pin: bool = False):
        self.pin = pin

    def allocate(self, key: str, layout: list[tuple[int, int, torch.dtype]], total: int) -> list[torch.Tensor]:
        return [torch.zeros(n, dtype=dtype, pin_memory=self.pin) for _, n, dtype in layout]

    def release(self, key: str, lo: int, hi: int) -> None:
        pass

    def release_all(self) -> None:
        pass


def _remove(paths: list, directory: Path | None) -> None:
    for p in paths:
        with_suppressed(os.unlink, p)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


def with_suppressed(fn, *args) -> None:
    try:
        fn(*args)
    except OSError:
        pass


def _state_keys(cls: type, hyper: dict) -> tuple[list[str], bool]:
    """The per-element state tensors `cls` keeps (e.g. exp_avg, exp_avg_sq; momentum_buffer) and whether it counts
    steps, from one probe step."""
    p = torch.zeros(3, requires_grad=True)
    p.grad = torch.ones(3)
    probe = cls([{"params": [p], **{**hyper, "lr": 0.0, "foreach": False, "fused": False}}])
    probe.step()
    state = probe.state[p]
    return sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == p.shape), "step" in state


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's piece on this rank (a plain tensor is its own)."""
    return t.to_local() if isinstance(t, DTensor) else t


def like(p: torch.Tensor, piece: torch.Tensor) -> torch.Tensor:
    """State for parameter p from this rank's piece: a DTensor placed as p is (so checkpoints reshard it), or the
    piece itself."""
    if not isinstance(p, DTensor):
        return piece
    return DTensor.from_local(piece, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


class ChunkedOffload(torch.optim.Optimizer):
    """`inner`'s update, chunk by chunk, with the state in `store` (see the module docstring)."""

    def __init__(self, inner: torch.optim.Optimizer, store, chunk_numel: int = CHUNK_NUMEL):
        groups = [{k: v for k, v in g.items()} for g in inner.param_groups]
        super().__init__(groups, inner.defaults)
        self.cls: Any = type(inner)  # the wrapped optimizer's class: a worker of it steps each chunk
        self.store = store
        self.chunk_numel = max(1, chunk_numel)
        hyper = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        self.keys, counts_steps = _state_keys(self.cls, hyper)
        params = [p for g in self.param_groups for p in g["params"]]
        page, offset, layout, self.offsets = mmap.PAGESIZE, 0, [], {}
        for p in params:  # each parameter's region starts on a page: releasing one chunk never drops another's
            mine = local(p)  # a DTensor's (tensor parallel, FSDP2) state is its shard's: this rank's piece
            layout.append((offset, mine.numel(), mine.dtype))
            self.offsets[p] = offset
            offset += -(-mine.numel() * mine.element_size() // page) * page
        # what memory reports as offloaded (plait.train.memory)
        self.offloaded_bytes = sum(local(p).numel() * p.element_size() for p in params) * len(self.keys)
        flat = {key: self.store.allocate(key, layout, offset) for key in self.keys}
        for i, p in enumerate(params):
            self.state[p] = {key: like(p, flat[key][i].view_as(local(p))) for key in self.keys}
            if counts_steps:  # a float32 CPU tensor, as torch's own optimizers keep it
                self.state[p]["step"] = torch.zeros((), dtype=torch.float32)
        self.chunks = self._cut(params)
        self.device_buffers: dict[tuple, torch.Tensor] = {}

    def _cut(self, params: list) -> list[list[tuple]]:
        """Chunks of at most chunk_numel elements: lists of (group index, param, lo, hi) pieces, in group order."""
        chunks, current, filled = [], [], 0
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                n = local(p).numel()
                if not local(p).is_contiguous():  # cannot be sliced flat: one piece, whatever its size
                    chunks.append([(gi, p, 0, n)])
                    continue
                lo = 0
                while lo < n:
                    take = min(n - lo, self.chunk_numel - filled)
                    current.append((gi, p, lo, lo + take))
                    lo, filled = lo + take, filled + take
                    if filled == self.chunk_numel:
                        chunks.append(current)
                        current, filled = [], 0
        if current:
            chunks.append(current)
        return chunks

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for chunk in self.chunks:
            self._step_chunk(chunk)
        for p, state in self.state.items():
            if p.grad is not None and "step" in state:
                state["step"] += 1
        return loss

    def _step_chunk(self, chunk: list[tuple]) -> None:
        groups: dict[int, dict] = {}
        staged: list[tuple] = []  # (device view, store view): state copied to the device and back after the step
        worker_state = {}
        for gi, p, lo, hi in chunk:
            if p.grad is None:
                continue
            mine, grad = local(p).detach(), local(p.grad)
            whole = lo == 0 and hi == mine.numel()
            view = mine if whole else mine.view(-1)[lo:hi]
            view.grad = grad if whole else grad.view(-1)[lo:hi]
            state = self.state[p]
            piece = {"step": state["step"].clone()} if "step" in state else {}
            for key in self.keys:
                src = local(state[key]) if whole else local(state[key]).view(-1)[lo:hi]
                if src.device != p.device:
                    dst = self._device_buffer(key, len(staged), src)
                    dst.copy_(src, non_blocking=True)
                    staged.append((dst, src))
                    src = dst
                piece[key] = src
            worker_state[view] = piece
            groups.setdefault(gi, {k: v for k, v in self.param_groups[gi].items() if k != "params"} | {"params": []})
            groups[gi]["params"].append(view)
        if not worker_state:
            return
        worker = self.cls(list(groups.values()))
        for view, piece in worker_state.items():
            worker.state[view] = piece
        worker.step()
        for dst, src in staged:
            src.copy_(dst)
        for _, p, lo, hi in chunk:
            size = p.element_size()
            base = self.offsets[p]
            for key in self.keys:
                self.store.release(key, base + lo * size, base + hi * size)

    def _device_buffer(self, key: str, slot: int, like: torch.Tensor) -> torch.Tensor:
        """A reusable device buffer for one piece of a chunk's state (one chunk's worth per key)."""
        name = (key, slot, like.dtype)
        buf = self.device_buffers.get(name)
        if buf is None or buf.numel() < like.numel():
            buf = self.device_buffers[name] = torch.empty(max(like.numel(), 1), dtype=like.dtype,
                                                          device=self.param_groups[0]["params"][0].device)
        return buf[:like.numel()].view_as(like)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load as torch does, then move the loaded tensors into the store (the state stays offloaded)."""
        homes = {p: dict(s) for p, s in self.state.items()}
        super().load_state_dict(state_dict)
        for p, home in homes.items():
            loaded = self.state.get(p, {})
            for key in self.keys:
                if key in loaded and loaded[key] is not home[key]:
                    home[key].copy_(loaded[key])
            if "step" in loaded and "step" in home:
                home["step"].copy_(torch.as_tensor(loaded["step"], dtype=torch.float32))
            self.state[p] = home
        self.store.release_all()


def offload_optimizer(optimizer: torch.optim.Optimizer, mode: str, device: torch.device, directory: Path | None,
                      chunk_numel: int = CHUNK_NUMEL, log=print) -> torch.optim.Optimizer:
    """The optimizer as parallel.offload asks: on disk ("disk") or in host memory ("optimizer", GPU runs only)."""
    if mode == "optimizer" and device.type == "cpu":
        log("note: parallel.offload = 'optimizer' has no effect on a CPU run (the optimizer state already lives in "
            "CPU memory)")
    if mode == "disk":
        if directory is None:  # a run without a run dir: scratch files, removed at exit
            return ChunkedOffload(optimizer, DiskStore(Path(tempfile.mkdtemp(prefix="plait-offload-")), True),
                                  chunk_numel)
        return ChunkedOffload(optimizer, DiskStore(directory), chunk_numel)
    if mode == "optimizer" and device.type != "cpu":
        return ChunkedOffload(optimizer, HostStore(pin=device.type == "cuda"), chunk_numel)
    return optimizer


def offload_dir(run_dir: Path | None, rank: int) -> Path | None:
    """Where rank `rank` keeps disk-offloaded state: RUN_DIR/offload/rank-R (None without a run dir)."""
    return None if run_dir is None else Path(run_dir) / "offload" / f"rank-{rank}"


def wrap(optimizer: torch.optim.Optimizer, b: Build) -> torch.optim.Optimizer:
    """The step owner's optimizer with its state where parallel.offload puts it (RUN_DIR/offload/rank-R for disk)."""
    return offload_optimizer(optimizer, b.layout.offload, b.rt.device, offload_dir(b.run_dir, b.rt.rank), log=b.rt.print)
