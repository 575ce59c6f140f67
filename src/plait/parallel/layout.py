"""The one owner of a job's parallel degrees, its ranks' roles, its meshes and what the layout can do.

    layout = Layout.from_config(cfg)                  # checks the arithmetic, numbers in the message
    layout = Layout.resolve(cfg, world)               # on `world` processes: parallel.dp = "auto" derived from it
    new = resized(cfg, world)                         # a copy of cfg whose dp follows `world`, other degrees kept
    layout.world_size                                 # dp * cp * tp * pp (+ the parameter servers)
    layout.role(rank)                                 # "trainer", or a parameter server's "worker" / "server"
    layout.coords(rank)                               # {"pp", "dp", "tp", "cp", "batch"} of a training rank
    layout.plain_data_parallel, layout.shards_gradients, layout.outputs_on_one_rank, ...   # named predicates
    rt = layout.init_runtime(cfg.launch)              # process group (or RPC), the mesh and the expert mesh

Config checks, the schemes, the runtime, the planner (which enumerates Layouts) and the launcher all
ask this object; nothing else multiplies degrees or decides what kind of layout a job has. Every front end that
fits a job to a count of processes (parallel.dp = "auto", plait slurm / k8s, an elastic resize, plait cluster run)
goes through Layout.resolve, which knows every degree: a dp = 1, cp = 2 job on 2 processes stays one. The mesh
is (pp, dp, tp), tp innermost: a tensor-parallel group is made of consecutive ranks (one machine, the
fastest links), pipeline stages are the outermost split. Expert parallelism cuts each dp group into
(ep_replica, ep): ep consecutive dp ranks share out the experts, ep_replica holds the same ones.

Context parallelism (cp > 1) cuts the sequence, not the model: the ranks of a cp group hold the same
weights and see the same samples, each its own tokens (plait.parallel.context). For everything that
averages gradients or losses (DDP, ZeRO, FSDP, the reported loss) they are data-parallel replicas, so
the mesh's "dp" axis holds dp * cp ranks, cp consecutive ones to a group (torchtitan's dp_shard_cp);
each rank's loss is the mean over its own tokens, equal in number, so their average is the sequence's.
What reads the global batch asks for the "batch" coordinate instead (the true dp one, dp of them): the
ranks of a cp group read the same samples. The cp groups are cut out of the dp axis, as ep's are.

With a parameter server (parallel.sync = 'ps') ranks [0, dp) are workers and [dp, dp + ps_servers)
servers (none with parallel.ps_placement = 'colocated': each worker serves a shard). Workers join
no process group (a dead worker must not leave the others stuck in a collective), but each knows
its dp coordinate, so every worker, the chief included, loads only its own slice of each global
batch.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

from plait.errors import ConfigError

AXES = ("pp", "dp", "tp")
EXPERT_AXES = ("pp", "ep_replica", "ep", "tp")


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0  # ZeRO stage on the dp axis
    micro_batch: int = 0  # samples per forward/backward (0: unknown, e.g. for a layout alone)
    schedule: str = "1f1b"  # the pipeline schedule (pp > 1)
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved-1f1b)
    activation_checkpointing: bool = False
    sequence_parallel: bool = False
    ep: int = 1  # expert parallel: each MoE layer's experts split over ep of the dp ranks
    sync: str = "allreduce"  # how dp replicas agree: allreduce, ps or gossip
    ps_servers: int = 0  # parameter-server processes beside the dp workers (0: none)
    ps_colocated: bool = False  # a parameter server whose shards live in the dp workers (no server processes)
    embedding_sharding: str = "none"
    offload: str = "none"  # where optimizer state lives: none, disk, optimizer (host), params (FSDP2's CPU offload)
    loss_scaling: bool = False  # fp16: dynamic loss scaling, every rank agreeing on an overflow
    global_batch: int = 0  # samples per optimizer step (0: unknown)
    microbatches: int = 0  # pipeline micro-batches per step (0: the accumulation count)
    nodes: tuple[int, int] = (1, 1)  # (min, max) machines: an elastic range when they differ
    nproc_per_node: int = 0  # launch.nproc_per_node (0: the layout spread evenly over the machines)
    cp: int = 1  # context parallel: each sequence's tokens split over cp ranks (ring attention)
    members: int = 1  # model.ensemble spread over the dp ranks: groups of dp ranks, one member each (dp: per group)

    @classmethod
    def from_config(cls, cfg) -> Layout:
        """The layout of a Config; raises ConfigError when the degrees and batch sizes do not fit together."""
        layout = cls._of(cfg, cfg.parallel.dp)
        layout.check()
        return layout

    @classmethod
    def _of(cls, cfg, dp: int) -> Layout:
        """cfg's layout with parallel.dp = dp (a spread ensemble's members taken out of it), unchecked."""
        p, t = cfg.parallel, cfg.train
        colocated = p.sync == "ps" and p.ps_placement == "colocated"
        nproc = cfg.launch.nproc_per_node
        members = spread_members(cfg, dp)
        return cls(dp // members, p.tp, p.pp, p.zero, t.micro_batch_size, p.pp_schedule, p.virtual_stages,
                   t.activation_checkpointing, p.sequence_parallel, p.ep, p.sync, dedicated_servers(cfg), colocated,
                   p.embedding_sharding, p.offload, cfg.precision.dtype == "fp16", t.global_batch_size, p.microbatches,
                   cfg.node_range, nproc if isinstance(nproc, int) else 0, p.cp, members)

    @classmethod
    def resolve(cls, cfg, world: int, where: str = "WORLD_SIZE") -> Layout:
        """cfg's layout on `world` processes: the one place a degree is derived from a count of processes.

        parallel.dp = "auto" becomes (world - parameter servers) / (cp * tp * pp), every other degree kept; a number
        is checked instead (dp * cp * tp * pp + servers must be the world). Either way a ConfigError shows the
        arithmetic, `where` naming the count ("--nodes 2 x --gpus-per-node 8"). The batch is left to the caller
        (a launcher may change the micro batch first): layout.check() says whether it splits.
        """
        p = cfg.parallel
        for axis in ("tp", "pp", "cp", "ep", *(("dp",) if p.dp != "auto" else ())):
            _check_degree(axis, getattr(p, axis))
        if p.dp != "auto":
            layout = cls._of(cfg, p.dp)
            layout.check_world(world, where)
            return layout
        servers, per = dedicated_servers(cfg), replica_procs(cfg)
        terms = _terms(p.cp, p.tp, p.pp) + (f" + ps_servers({servers})" if servers else "")
        workers = world - servers
        axes = [f"parallel.{a}" for a in ("cp", "tp", "pp") if getattr(p, a) > 1] + ["parallel.ps_servers"] * bool(servers)

        def count(n: int) -> str:  # the world sizes that fit, in words
            return f"{servers} + a multiple of {n}" if servers else f"a multiple of {n}"

        if workers < per or workers % per:
            raise ConfigError(
                f"no whole parallel.dp fits {where} = {world} processes: dp * {terms} = {world} leaves dp = "
                f"{workers} / {per}; give the job {count(per)} processes" + (f", or change {' or '.join(axes)}" if axes else ""))
        dp = workers // per
        if dp % p.ep:
            raise ConfigError(
                f"no whole parallel.dp fits {where} = {world} processes with parallel.ep = {p.ep}: dp * {terms} = "
                f"{world} gives dp = {dp}, not a multiple of ep({p.ep}) (an expert-parallel group is ep dp ranks); "
                f"give the job {count(per * p.ep)} processes, or change parallel.ep")
        return cls._of(cfg, dp)

    # ---- arithmetic
    def check(self) -> None:
        for axis in ("dp", "tp", "pp", "ep", "cp"):
            _check_degree(axis, getattr(self, axis))
        if self.global_batch and self.micro_batch:
            per_step = self.micro_batch * self.dp
            dp = f"parallel.dp / model.ensemble ({self.dp}: each member's ranks)" if self.members > 1 else \
                f"parallel.dp ({self.dp})"
            if self.global_batch % per_step:
                raise ConfigError(
                    f"train.global_batch_size ({self.global_batch}) must be divisible by train.micro_batch_size "
                    f"({self.micro_batch}) * {dp} = {per_step}; "
                    f"change train.global_batch_size to a multiple of {per_step} or lower train.micro_batch_size")

    @property
    def trainers(self) -> int:
        """Processes on the (pp, dp, tp) mesh: dp * cp * members * tp * pp."""
        return self.replicas * self.tp * self.pp

    @property
    def replicas(self) -> int:
        """Ranks on the mesh's dp axis, which average losses (and, but for a spread ensemble's members, gradients):
        dp * cp * members (a cp group's ranks see the same samples, each its own tokens; an ensemble member's group
        of dp ranks trains that member alone)."""
        return self.dp * self.cp * self.members

    devices = trainers  # the planner's word for it

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

    @property
    def pipeline_microbatches(self) -> int:
        """Pipeline micro-batches per step: parallel.microbatches, else the accumulation count."""
        return self.microbatches or self.grad_accum

    @property
    def stages(self) -> int:
        """Pipeline stages the model is cut into: pp * virtual_stages."""
        return self.pp * self.virtual_stages

    # ---- what the layout is: the predicates every check and scheme asks (never the degrees by hand)
    @property
    def ps(self) -> bool:
        """Whether the ranks are a parameter server's workers (and servers) rather than a mesh."""
        return self.sync == "ps" and (bool(self.ps_servers) or self.ps_colocated)

    @property
    def data_parallel_only(self) -> bool:
        """No axis but dp cuts the model (ZeRO may shard it over dp): tp = pp = ep = 1, no sharded embeddings, and
        the replicas average by all-reduce."""
        return (self.tp == 1 and self.pp == 1 and self.ep == 1 and self.embedding_sharding == "none"
                and self.sync == "allreduce")

    @property
    def plain_data_parallel(self) -> bool:
        """Whole replicas averaging by all-reduce, nothing sharded: data_parallel_only with zero = 0."""
        return self.data_parallel_only and self.zero == 0

    @property
    def replicas_without_a_mesh_axis(self) -> bool:
        """Whole replicas on the dp axis alone, however they agree (all-reduce, parameter server, gossip): what a
        parameter server or gossip replaces DDP on. tp = pp = ep = cp = 1, zero = 0, no sharded embeddings."""
        return (self.tp == 1 and self.pp == 1 and self.ep == 1 and self.cp == 1 and self.zero == 0
                and self.embedding_sharding == "none")

    @property
    def splits_model(self) -> bool:
        """A rank holds part of each step's model compute: tensor or pipeline parallel."""
        return self.tp > 1 or self.pp > 1

    @property
    def shards_optimizer(self) -> bool:
        """ZeRO >= 1 over the dp axis (dp * cp ranks): each holds 1/(dp * cp) of the optimizer state."""
        return self.zero >= 1 and self.replicas > 1

    @property
    def shards_gradients(self) -> bool:
        """ZeRO >= 2 over dp ranks: gradients reduce-scattered, and (FSDP2) parameters sharded at rest."""
        return self.zero >= 2 and self.replicas > 1

    @property
    def elementwise_optimizer_only(self) -> bool:
        """The optimizer steps on pieces of tensors (ZeRO-2/3's shards of each tensor, offload's chunks), so its update
        must be elementwise. ZeRO-1 gives each rank whole tensors (plait.parallel.zero): any optimizer steps them."""
        return self.zero >= 2 or self.offload in ("disk", "optimizer")

    @property
    def optimizer_sees_whole_tensors(self) -> bool:
        """Every parameter the optimizer steps is a whole tensor on one rank (no tensor parallel, no server shards)."""
        return self.tp == 1 and not self.ps and self.sync != "ps"

    @property
    def outputs_on_one_rank(self) -> bool:
        """A rank computes the whole model's outputs for its samples (no pipeline stages, no parameter server)."""
        return self.pp == 1 and self.sync != "ps"

    @property
    def every_rank_evaluates(self) -> bool:
        """Every rank takes part in evaluation (a parameter server's workers do not)."""
        return self.sync != "ps"

    @property
    def elastic(self) -> bool:
        """The number of machines may change while the job runs."""
        return self.nodes[0] < self.nodes[1]

    def describe(self) -> str:
        """The degrees for an error message: "dp = 2, tp = 1, pp = 1, ep = 1, zero = 0, sync = 'allreduce'"."""
        return (f"dp = {self.dp * self.members}, tp = {self.tp}, pp = {self.pp}, ep = {self.ep}, zero = {self.zero}, "
                f"sync = {self.sync!r}" + (f", cp = {self.cp}" if self.cp > 1 else ""))

    def formula(self) -> str:
        """The world size's arithmetic: "dp(2) * cp(2) * tp(1) * pp(1) + ps_servers(1)"."""
        text = f"dp({self.dp * self.members}) * {_terms(self.cp, self.tp, self.pp)}"
        return text + (f" + ps_servers({self.ps_servers})" if self.ps_servers else "")

    # ---- the launch
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
        """(pp, dp, tp) mesh coordinates of a training rank, its place in its cp group ("cp") and the slice of the
        global batch it reads ("batch": dp // cp on the mesh's dp axis); a parameter-server worker's dp and batch
        coordinate is its rank."""
        if self.ps:
            if rank >= self.dp:
                raise ValueError(f"rank {rank} is a parameter server, not on the mesh")
            return {"pp": 0, "dp": rank, "tp": 0, "cp": 0, "batch": rank}
        pp, rest = divmod(rank, self.replicas * self.tp)
        dp, tp = divmod(rest, self.tp)
        member, within = divmod(dp, self.dp * self.cp)
        batch, cp = divmod(within, self.cp)
        coords = {"pp": pp, "dp": dp, "tp": tp, "cp": cp, "batch": batch}
        return coords | {"member": member} if self.members > 1 else coords

    # ---- the planner's view
    def sets(self) -> str:
        """The layout as ready --set arguments."""
        parts = [f"parallel.dp={self.dp}", f"parallel.tp={self.tp}", f"parallel.pp={self.pp}",
                 f"parallel.zero={self.zero}", f"train.micro_batch_size={self.micro_batch}"]
        if self.pp > 1:
            parts.append(f"parallel.pp_schedule='{self.schedule}'")
            if self.virtual_stages > 1:
                parts.append(f"parallel.virtual_stages={self.virtual_stages}")
        if self.sequence_parallel:
            parts.append("parallel.sequence_parallel=true")
        if self.ep > 1:
            parts.append(f"parallel.ep={self.ep}")
        if self.cp > 1:
            parts.append(f"parallel.cp={self.cp}")
        if self.activation_checkpointing:
            parts.append("train.activation_checkpointing=true")
        return " ".join(f"--set {p}" for p in parts)

    def label(self) -> str:
        s = f"dp{self.dp} tp{self.tp} pp{self.pp} z{self.zero} mb{self.micro_batch}"
        if self.pp > 1:
            s += f" {self.schedule}" + (f"x{self.virtual_stages}" if self.virtual_stages > 1 else "")
        return (s + (" sp" if self.sequence_parallel else "") + (" ac" if self.activation_checkpointing else "")
                + (f" ep{self.ep}" if self.ep > 1 else "") + (f" cp{self.cp}" if self.cp > 1 else ""))

    # ---- the runtime
    def init_runtime(self, launch_cfg):
        """Join the job as this layout says: a process group, the named mesh (and the expert mesh), or RPC."""
        from plait.runtime import Runtime, init_process_group  # lazily: the layout's arithmetic needs no torch

        if self.ps:
            return self._init_ps(launch_cfg)
        rank, world, local_rank, device, backend = init_process_group(launch_cfg)
        self.check_world(world)
        mesh = experts = context = ensemble = None
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh  # lazily: as the runtime above

            mesh = init_device_mesh(device.type, (self.pp, self.replicas, self.tp), mesh_dim_names=AXES)
            if self.ep > 1:  # the dp axis cut into (ep_replica, ep): groups for the two new axes only
                experts = mesh._unflatten("dp", (self.dp // self.ep, self.ep), EXPERT_AXES[1:3])["ep_replica", "ep"]
            if self.cp > 1:  # the dp axis cut into (batch, cp): the cp groups, cp consecutive dp ranks each
                context = mesh._unflatten("dp", (self.dp, self.cp), ("batch", "cp"))["cp"]
            if self.members > 1:  # the dp axis cut into (member, batch): a member's replicas, and one rank per member
                ensemble = mesh._unflatten("dp", (self.members, self.dp), ("member", "batch"))["member", "batch"]
        return Runtime(rank, world, local_rank, device, backend, mesh, "trainer", self.coords(rank),
                       {"pp": self.pp, "dp": self.replicas, "tp": self.tp, "ep": self.ep, "cp": self.cp,
                        "batch": self.dp, "member": self.members}, expert_mesh=experts, context_mesh=context,
                       ensemble_mesh=ensemble)

    def _init_ps(self, launch_cfg):
        import torch  # lazily: as in init_runtime

        from plait.ps.rpc import join  # lazily: as torch above
        from plait.runtime import Runtime, pick_device  # lazily: as torch above

        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        self.check_world(world)
        role = self.role(rank)
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cpu") if role == "server" else pick_device(launch_cfg.device, local_rank)
        join(rank, world, self.dp, launch_cfg.timeout_s)
        coords = self.coords(rank) if role != "server" else {"pp": 0, "dp": 0, "tp": 0, "cp": 0, "batch": 0}
        return Runtime(rank, world, local_rank, device, "rpc", None, role, coords,
                       {"pp": 1, "dp": self.dp, "tp": 1, "batch": self.dp})


def spread_members(cfg, dp: int | None = None) -> int:
    """model.ensemble = K spread over the dp ranks (K groups of dp / K ranks, each training one member on the whole
    global batch, as its own run would): when dp (default parallel.dp) is a multiple of K and the replicas are plain
    DDP ones (zero = 0, tp = pp = cp = ep = 1, all-reduce); 1 otherwise (every rank runs every member)."""
    k, p = cfg.model.ensemble, cfg.parallel
    dp = p.dp if dp is None else dp
    plain = p.zero == 0 and p.tp == p.pp == p.cp == p.ep == 1 and p.sync == "allreduce" and p.embedding_sharding == "none"
    return k if k > 1 and dp >= k and dp % k == 0 and plain else 1


def dedicated_servers(cfg) -> int:
    """Parameter-server processes beside cfg's data-parallel workers: parallel.ps_servers with sync = 'ps' and
    dedicated placement, else none."""
    p = cfg.parallel
    return p.ps_servers if p.sync == "ps" and p.ps_placement == "dedicated" else 0


def replica_procs(cfg) -> int:
    """Processes one data-parallel replica of cfg spans, cp * tp * pp: a world size is a multiple of it (plus the
    parameter servers), and a job grows or shrinks by it."""
    p = cfg.parallel
    return p.cp * p.tp * p.pp


def resized(cfg, world: int, where: str = "WORLD_SIZE"):
    """A copy of cfg for `world` processes: parallel.dp from Layout.resolve, every other degree kept; with one
    data-parallel replica left (dp * cp = 1) what shards over replicas (ZeRO, offload, embedding sharding) is off."""
    new = copy.deepcopy(cfg)
    new.parallel.dp = "auto"
    layout = Layout.resolve(new, world, where)
    new.parallel.dp = layout.dp * layout.members
    if layout.replicas == 1:
        new.parallel.zero, new.parallel.offload, new.parallel.embedding_sharding = 0, "none", "none"
    return new


def _check_degree(axis: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"parallel.{axis} = {value!r} must be >= 1; set --set parallel.{axis}=1")


def _terms(cp: int, tp: int, pp: int) -> str:
    """The degrees one data-parallel replica spans, for messages: "cp(2) * tp(1) * pp(1)" (cp only when > 1)."""
    return (f"cp({cp}) * " if cp > 1 else "") + f"tp({tp}) * pp({pp})"
