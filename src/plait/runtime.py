"""Process group, device, named device mesh, seeding and rank-aware printing for one worker.

The same code runs in every process of every layout: under plait's launcher,
under a plain `torchrun -m plait train ...`, in the test harness (which makes the
process group itself) or as a single process with no process group at all.
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass

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
    mesh: object | None  # DeviceMesh with axes ("pp", "dp", "tp"), None for a single process
    role: str = "trainer"  # see ps_role: "trainer", or a parameter server's "worker" / "server"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """In a process group with others (a parameter server's ranks talk by RPC only)."""
        return self.world_size > 1 and self.mesh is not None

    def axis_group(self, axis: str):
        """The process group of one mesh axis (None when single-process)."""
        return None if self.mesh is None else self.mesh[axis].get_group()

    def axis_rank(self, axis: str) -> int:
        return 0 if self.mesh is None else self.mesh[axis].get_local_rank()

    def axis_size(self, axis: str) -> int:
        return 1 if self.mesh is None else self.mesh[axis].size()

    def print(self, *args, **kwargs) -> None:
        """Print on rank 0 only."""
        if self.is_main:
            print(*args, **kwargs, flush=True)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


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


def ps_role(rank: int, parallel_cfg) -> str:
    """What a rank does: "trainer" runs plait's trainer loop (every rank, except with parallel.sync = 'ps').

    With a parameter server, ranks [0, dp) are workers and [dp, dp + ps_servers) servers; worker 0, the
    chief, runs the trainer ("trainer"), the others are "worker" and "server" (plait.ps).
    """
    if getattr(parallel_cfg, "sync", "allreduce") != "ps" or rank == 0:
        return "trainer"
    return "worker" if rank < parallel_cfg.dp else "server"


def _init_ps(launch_cfg, parallel_cfg) -> Runtime:
    """A parameter-server rank: no process group, an RPC agent (plait.ps.rpc) and its role."""
    from plait.ps.rpc import join

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    need = parallel_cfg.dp + parallel_cfg.ps_servers
    if world != need:
        raise ConfigError(
            f"parallel.sync = 'ps' needs dp({parallel_cfg.dp}) + ps_servers({parallel_cfg.ps_servers}) = {need} processes "
            f"but this job has WORLD_SIZE = {world}; change parallel.dp, parallel.ps_servers or the number of processes")
    role = ps_role(rank, parallel_cfg)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu") if role == "server" else pick_device(launch_cfg.device, local_rank)
    join(rank, world, parallel_cfg.dp, launch_cfg.timeout_s)
    return Runtime(rank, world, local_rank, device, "rpc", None, role)


def init_runtime(launch_cfg, parallel_cfg) -> Runtime:
    """Join (or reuse) the default process group and build the named mesh for the layout."""
    if getattr(parallel_cfg, "sync", "allreduce") == "ps":
        return _init_ps(launch_cfg, parallel_cfg)
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
        store = _attempt_store(env_world, timeout) if "TORCHELASTIC_RESTART_COUNT" in os.environ else None
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
    if getattr(launch_cfg, "check_collectives", False) and world > 1:
        from plait.comm import accounting
        from plait.comm.fingerprint import Fingerprinter

        accounting.fingerprinter = Fingerprinter(dist.distributed_c10d._get_default_store(), dist.get_rank())
    rank = dist.get_rank() if backend else 0
    need = parallel_cfg.dp * parallel_cfg.tp * parallel_cfg.pp
    if world != need:
        raise ConfigError(
            f"the layout needs dp({parallel_cfg.dp}) * tp({parallel_cfg.tp}) * pp({parallel_cfg.pp}) = {need} "
            f"processes but this job has WORLD_SIZE = {world}; change parallel.dp or the number of processes"
        )
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(
            device.type,
            (parallel_cfg.pp, parallel_cfg.dp, parallel_cfg.tp),
            mesh_dim_names=("pp", "dp", "tp"),
        )
    return Runtime(rank, world, local_rank, device, backend, mesh)


def _attempt_store(world: int, timeout):
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


def under_torchrun() -> bool:
    """True inside a process started by torchrun's agent (plait's launcher or a plain torchrun)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def is_tty() -> bool:
    return sys.stdout.isatty()
