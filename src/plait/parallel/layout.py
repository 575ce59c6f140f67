"""The one source of truth for a job's parallel degrees, its ranks' roles and its device mesh.

    layout = Layout.from_config(cfg)                  # checks the arithmetic, numbers in the message
    layout.world_size                                 # dp * tp * pp (+ the parameter servers)
    layout.role(rank)                                 # "trainer", or a parameter server's "worker" / "server"
    layout.coords(rank)                               # {"pp": .., "dp": .., "tp": ..} of a training rank
    rt = layout.init_runtime(cfg.launch)              # process group (or RPC) and the named mesh

Config validation, the runtime, the planner and the launcher all ask this object; nothing else
multiplies degrees. The mesh is (pp, dp, tp), tp innermost: a tensor-parallel group is made of
consecutive ranks (one machine, the fastest links), pipeline stages are the outermost split.

With a parameter server (parallel.sync = 'ps') ranks [0, dp) are workers and [dp, dp + ps_servers)
servers (none with parallel.ps_placement = 'colocated': each worker serves a shard). Workers join
no process group (a dead worker must not leave the others stuck in a collective), but each knows
its dp coordinate, so every worker, the chief included, loads only its own slice of each global
batch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from plait.errors import ConfigError
from plait.ps.rpc import join
from plait.runtime import Runtime, init_process_group, pick_device

AXES = ("pp", "dp", "tp")


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    ps_servers: int = 0  # parameter-server processes beside the dp workers (0: none)
    global_batch: int = 0  # samples per optimizer step (0: unknown, e.g. for a layout alone)
    micro_batch: int = 0  # samples per forward/backward
    ps_colocated: bool = False  # a parameter server whose shards live in the dp workers (no server processes)

    @classmethod
    def from_config(cls, cfg) -> Layout:
        """The layout of a Config; raises ConfigError when the degrees and batch sizes do not fit together."""
        p, t = cfg.parallel, cfg.train
        colocated = p.sync == "ps" and p.ps_placement == "colocated"
        layout = cls(p.dp, p.tp, p.pp, p.ps_servers if p.sync == "ps" and not colocated else 0, t.global_batch_size,
                     t.micro_batch_size, colocated)
        layout.check()
        return layout

    # ---- arithmetic
    def check(self) -> None:
        for axis in ("dp", "tp", "pp"):
            if getattr(self, axis) < 1:
                raise ConfigError(f"parallel.{axis} = {getattr(self, axis)} must be >= 1; set --set parallel.{axis}=1")
        if self.global_batch and self.micro_batch:
            per_step = self.micro_batch * self.dp
            if self.global_batch % per_step:
                raise ConfigError(
                    f"train.global_batch_size ({self.global_batch}) must be divisible by train.micro_batch_size "
                    f"({self.micro_batch}) * parallel.dp ({self.dp}) = {per_step}; "
                    f"change train.global_batch_size to a multiple of {per_step} or lower train.micro_batch_size")

    @property
    def ps(self) -> bool:
        """Whether the ranks are a parameter server's workers (and servers) rather than a mesh."""
        return bool(self.ps_servers) or self.ps_colocated

    @property
    def trainers(self) -> int:
        """Processes on the (pp, dp, tp) mesh: dp * tp * pp."""
        return self.dp * self.tp * self.pp

    @property
    def world_size(self) -> int:
        """Processes the job needs: the mesh, plus the parameter servers."""
        return self.trainers + self.ps_servers

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step on each data-parallel rank."""
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def local_batch(self) -> int:
        """Samples per step on one data-parallel rank."""
        return self.global_batch // self.dp

    def formula(self) -> str:
        text = f"dp({self.dp}) * tp({self.tp}) * pp({self.pp})"
        return text + (f" + ps_servers({self.ps_servers})" if self.ps_servers else "")

    def check_world(self, world: int, where: str = "this job has WORLD_SIZE") -> None:
        """Raise, showing the arithmetic, unless `world` processes are what the layout needs."""
        if world != self.world_size:
            raise ConfigError(
                f"the layout needs {self.formula()} = {self.world_size} processes but {where} = {world}; "
                "change parallel.dp (or the other degrees) or the number of processes")

    def procs_per_node(self, nodes: int, nproc_per_node: int = 0) -> int:
        """Worker processes per machine: launch.nproc_per_node, or the layout spread evenly over `nodes`."""
        if nproc_per_node > 0:
            return nproc_per_node
        return max(1, self.world_size // nodes)

    def check_launch(self, nodes: int, nnodes_text: str, nproc_per_node: int) -> None:
        """The launch gives exactly the processes the layout needs."""
        if nproc_per_node == 0 and self.world_size % nodes:
            raise ConfigError(
                f"{self.formula()} = {self.world_size} processes cannot be split evenly over launch.nnodes = "
                f"{nnodes_text}; change parallel.dp or launch.nnodes (or set launch.nproc_per_node)")
        per_node = self.procs_per_node(nodes, nproc_per_node)
        if per_node * nodes != self.world_size:
            raise ConfigError(
                f"the layout needs {self.formula()} = {self.world_size} processes but the launch gives "
                f"nproc_per_node({per_node}) * nnodes({nodes}) = {per_node * nodes}; change parallel.dp or "
                "launch.nproc_per_node so that they match (or set launch.nproc_per_node=0)")

    # ---- roles and coordinates
    def role(self, rank: int) -> str:
        """"trainer" on the mesh; with a parameter server, worker 0 (the chief) is the "trainer" that writes the
        run's files, workers 1..dp-1 are "worker" and the rest "server"."""
        if not self.ps or rank == 0:
            return "trainer"
        return "worker" if rank < self.dp else "server"

    def coords(self, rank: int) -> dict[str, int]:
        """(pp, dp, tp) coordinates of a training rank; a parameter-server worker's dp coordinate is its rank."""
        if self.ps:
            if rank >= self.dp:
                raise ValueError(f"rank {rank} is a parameter server, not on the mesh")
            return {"pp": 0, "dp": rank, "tp": 0}
        pp, rest = divmod(rank, self.dp * self.tp)
        dp, tp = divmod(rest, self.tp)
        return {"pp": pp, "dp": dp, "tp": tp}

    # ---- the runtime
    def init_runtime(self, launch_cfg) -> Runtime:
        """Join the job as this layout says: a process group and the named mesh, or (parameter server) RPC."""
        if self.ps:
            return self._init_ps(launch_cfg)
        rank, world, local_rank, device, backend = init_process_group(launch_cfg)
        self.check_world(world)
        mesh = None
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device.type, (self.pp, self.dp, self.tp), mesh_dim_names=AXES)
        return Runtime(rank, world, local_rank, device, backend, mesh, "trainer", self.coords(rank),
                       {"pp": self.pp, "dp": self.dp, "tp": self.tp})

    def _init_ps(self, launch_cfg) -> Runtime:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        self.check_world(world)
        role = self.role(rank)
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cpu") if role == "server" else pick_device(launch_cfg.device, local_rank)
        join(rank, world, self.dp, launch_cfg.timeout_s)
        coords = self.coords(rank) if role != "server" else {"pp": 0, "dp": 0, "tp": 0}
        return Runtime(rank, world, local_rank, device, "rpc", None, role, coords, {"pp": 1, "dp": self.dp, "tp": 1})
