"""Process group, device, seeding and rank-aware printing for one worker (the mesh comes from plait.parallel.layout).

The same code runs in every process of every layout: under plait's launcher,
under a plain `torchrun -m plait train ...`, in the test harness (which makes the
process group itself) or as a single process with no process group at all.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from plait.errors import ConfigError


@dataclass
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None
    mesh: object | None  # DeviceMesh with axes ("pp", "dp", "tp"), None for a single process or a parameter server
    role: str = "trainer"  # "trainer", or a parameter server's "worker" / "server" (plait.parallel.layout)
    coords: dict = field(default_factory=dict)  # this rank's coordinate on each axis (the layout's, mesh or not)
    degrees: dict = field(default_factory=dict)  # each axis's size in the layout
    expert_mesh: object | None = None  # DeviceMesh ("ep_replica", "ep") of expert parallelism (ep > 1), from the layout
    context_mesh: object | None = None  # DeviceMesh ("cp",) of context parallelism (cp > 1), from the layout
    ensemble_mesh: object | None = None  # DeviceMesh ("member", "batch") of a spread ensemble (plait.parallel.ensemble)
    _groups: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """In a process group with others (a parameter server's ranks talk by RPC only)."""
        return self.world_size > 1 and self.mesh is not None

    def axis_group(self, axis: str):
        """The process group of one mesh axis (None when single-process or without a mesh)."""
        if self.mesh is None:
            return None
        if axis not in self._groups:  # slicing a DeviceMesh builds a sub-mesh: hundreds of microseconds, once
            self._groups[axis] = self.mesh[axis].get_group()
        return self._groups[axis]

    def replica_mesh(self):
        """The dp ranks that hold the same weights and average their gradients: the dp axis, or a spread ensemble
        member's own ranks."""
        return self.ensemble_mesh["batch"] if self.ensemble_mesh is not None else self.mesh["dp"]

    def axis_rank(self, axis: str) -> int:
        """This rank's coordinate on `axis` in the layout."""
        return self.coords.get(axis, 0)

    def axis_size(self, axis: str) -> int:
        """The layout's degree on `axis`."""
        return self.degrees.get(axis, 1)

    def group_size(self, axis: str) -> int:
        """Ranks that take part in a collective on `axis` with this one (1 without a process group)."""
        return self.axis_size(axis) if self.mesh is not None else 1

    def print(self, *args, **kwargs) -> None:
        """Print on rank 0 only."""
        if self.is_main:
            print(*args, **kwargs, flush=True)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def single_process(device: torch.device | None = None) -> Runtime:
    """The runtime of one process with no process group (tests, tools)."""
    return Runtime(0, 1, 0, device or torch.device("cpu"), None, None)


def pick_device(choice: str, local_rank: int) -> torch.device:
    """cuda:<local_rank> when CUDA is available (or asked for), else cpu."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("launch.device = 'cuda' but CUDA is not available here; set launch.device=auto or cpu")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def pick_backend(choice: str, device: torch.device) -> str:
    if choice != "auto":
        return choice
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(launch_cfg) -> tuple[int, int, int, torch.device, str | None]:
    """Join (or reuse) the default process group: (rank, world size, local rank, device, backend or None)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    if dist.is_available() and dist.is_initialized():
        local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        device = pick_device(launch_cfg.device, local_rank)
        backend = dist.get_backend()
    elif env_world > 1:
        device = pick_device(launch_cfg.device, local_rank)
        backend = pick_backend(launch_cfg.backend, device)
        timeout = datetime.timedelta(seconds=launch_cfg.timeout_s)
        store = attempt_store(env_world, timeout) if "TORCHELASTIC_RESTART_COUNT" in os.environ else None
        dist.init_process_group(
            backend=backend,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
            **({"store": store, "rank": int(os.environ["RANK"]), "world_size": env_world} if store else {}),
        )
    else:
        device = pick_device(launch_cfg.device, local_rank)
        backend = None
    world = dist.get_world_size() if backend else 1
    rank = dist.get_rank() if backend else 0
    return rank, world, local_rank, device, backend


def attempt_store(world: int, timeout):
    """The job's key-value store under a prefix of its own for each restart of the workers.

    After torchrun's agent restarts the workers, keys from the previous attempt (gloo's peer
    addresses, plait's heartbeats) may still be in the store; a fresh prefix keeps the new
    workers from reading them.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    rank = int(os.environ["RANK"])
    if agent_hosts_it:
        base = dist.TCPStore(host, port, world_size=world, is_master=False, timeout=timeout)
    else:
        base = dist.TCPStore(host, port, world_size=world, is_master=rank == 0, timeout=timeout, multi_tenant=True)
    return dist.PrefixStore(f"plait/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", base)


def seed_all(seed: int) -> None:
    """Seed torch's CPU and accelerator generators (model init draws from them)."""
    torch.manual_seed(seed)


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from several integers (e.g. seed, step, rank) without collisions of simple sums."""
    h = 0x243F6A8885A308D3
    for p in parts:
        h = (h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0x100000001B3 % (1 << 64)
        h ^= h >> 29
    return h % ((1 << 63) - 1)


def synchronize(device: torch.device) -> None:
    """Wait for queued accelerator work so that wall-clock timings are true."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)
