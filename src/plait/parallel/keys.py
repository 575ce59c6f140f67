"""The keys of the layout and of each parallel scheme: [parallel], [precision], and train's transforms.

Torch-free (plait config show lists them without importing torch). Each scheme's keys are a group of
their own, named for it, which its Scheme declares (`Scheme(..., keys=PipelineKeys)`) and receives in
its check; a group's `check(cfg)` holds the rules that need no layout. The degrees themselves
(dp, tp, pp, ep, cp, zero, sync) are the layout's: plait.parallel.layout.Layout reads them.
"""

from __future__ import annotations

from plait.config import keys, opt
from plait.errors import ConfigError


@keys("parallel")
class DegreeKeys:
    dp: int | str = opt(2, "data-parallel degree (model replicas); \"auto\": fill the machine's processes (every local "
                           "GPU, or launch.nproc_per_node) divided by tp x pp", minimum=1, fix="1")
    tp: int = opt(1, "tensor-parallel degree (each block's matrices split across ranks)", minimum=1, fix="1")
    pp: int = opt(1, "pipeline-parallel degree (stages of consecutive blocks)", minimum=1, fix="1")
    zero: int = opt(0, "ZeRO stage on the dp axis: 0 off, 1 optimizer states, 2 + gradients, 3 + parameters",
                    (0, 1, 2, 3))


@keys("parallel")
class OffloadKeys:
    offload: str = opt("none", "optimizer state out of device memory: none; disk (memory-mapped files under "
                       "RUN_DIR/offload, zero 0/1); optimizer (host memory, GPU runs, zero 0/1); params (FSDP2's CPU "
                       "offload of parameters, gradients and state, GPU runs, zero 2/3)",
                       ("none", "disk", "optimizer", "params"))


@keys("parallel")
class ShardInitKeys:
    shard_init: bool = opt(True, "zero 2/3, tp or pp: build the model on the meta device and materialise only this "
                           "rank's shards (the same values as a single process's initialisation, or this rank's slices "
                           "of train.init_from's checkpoint)")


@keys("parallel")
class PipelineKeys:
    pp_schedule: str = opt("1f1b", "pipeline schedule: gpipe, 1f1b, interleaved-1f1b or pipedream (PipeDream-2BW: 1F1B "
                           "with no flush between steps, weights stashed in two versions, updates one version stale)",
                           ("gpipe", "1f1b", "interleaved-1f1b", "pipedream"))
    microbatches: int = opt(0, "pipeline micro-batches per step (0: global_batch_size / (micro_batch_size * dp))",
                            minimum=0, why="0: derived", fix="0")
    virtual_stages: int = opt(1, "interleaved-1f1b: model chunks per pipeline rank", minimum=1, fix="1")
    pp_transport: str = opt("collective", "how stages exchange activations and gradients: collective "
                            "(torch.distributed.pipelining's schedules over send/recv) or rpc (each stage a RemoteModule, "
                            "backward through distributed autograd; pp only, gpipe)", ("collective", "rpc"))
    pp_split: list | str = opt([], "block indices where pipeline stages begin, e.g. [2] (empty: balance by parameters; "
                                   "\"auto\": by each block's time measured on each pipeline rank, HetPipe-style)")

    def check(self, cfg) -> None:
        if self.virtual_stages > 1 and self.pp_schedule != "interleaved-1f1b":
            raise ConfigError(
                f"parallel.virtual_stages = {self.virtual_stages} needs parallel.pp_schedule = 'interleaved-1f1b' "
                f"(it is {self.pp_schedule!r})")
        if isinstance(self.pp_split, str) and self.pp_split != "auto":
            raise ConfigError(f"parallel.pp_split = {self.pp_split!r}: give block indices (e.g. [2]), [] (balanced by "
                              "parameters) or 'auto' (balanced by measured block times)")
        if self.pp_split == "auto" and self.virtual_stages > 1:
            raise ConfigError("parallel.pp_split = 'auto' places one stage per pipeline rank; with "
                              f"parallel.virtual_stages = {self.virtual_stages} give the cut points")


@keys("parallel")
class TensorParallelKeys:
    sequence_parallel: bool = opt(False, "with tp: shard LayerNorm/dropout activations along the sequence")


@keys("parallel")
class SyncKeys:
    sync: str = opt("allreduce", "how dp replicas agree: allreduce, ps (parameter server) or gossip",
                    ("allreduce", "ps", "gossip"))


@keys("parallel")
class ParameterServerKeys:
    ps_servers: int = opt(1, "ps: parameter-server processes, in addition to the dp workers")
    ps_mode: str = opt("sync", "ps: sync, async, or ssp (bounded staleness)", ("sync", "async", "ssp"))
    ps_placement: str = opt("dedicated", "ps: dedicated (ps_servers processes beside the workers) or colocated (every "
                            "worker also serves 1/dp of the parameters, BytePS-style; no server processes)",
                            ("dedicated", "colocated"))
    staleness: int = opt(0, "ps ssp: steps a worker may run ahead of the slowest one", minimum=0,
                         why="how many steps a worker may run ahead of the slowest one; 0 = lockstep", fix="2")


@keys("parallel")
class GossipKeys:
    gossip_every: int = opt(1, "gossip: average with graph neighbours every N steps", minimum=1,
                            why="steps between neighbour averages", fix="1")
    gossip_topology: str = opt("ring", "gossip: ring or exponential graph", ("ring", "exponential"))
    gossip_async: bool = opt(False, "gossip: AD-PSGD, each active (even) rank averages with one random passive "
                                    "neighbour after its step, no global barrier (needs sync = 'gossip', even dp)")

    def check(self, cfg) -> None:
        sync = cfg.parallel.sync
        if self.gossip_async and sync != "gossip":
            raise ConfigError(f"parallel.gossip_async = true is asynchronous gossip and needs parallel.sync = 'gossip' "
                              f"(here {sync!r}); set parallel.sync='gossip' or parallel.gossip_async=false")


@keys("parallel")
class DDPKeys:
    """DDP's gradient all-reduce: compressed (a comm hook), or by one of plait's own algorithms."""

    compression: str = opt("none", "dp all-reduce compression: none, fp16, bf16, powersgd, topk or int8",
                           ("none", "fp16", "bf16", "powersgd", "topk", "int8"))
    powersgd_rank: int = opt(2, "compression = powersgd: rank of the low-rank approximation", minimum=1,
                             why="the rank of PowerSGD's approximation, e.g. 2", fix="2")
    topk_ratio: float = opt(0.01, "compression = topk: fraction of gradient entries sent")
    allreduce: str = opt("native", "DDP's gradient all-reduce: native (torch.distributed's) or plait's own ring, tree "
                         "(halving-doubling) or hierarchical (plait.comm.algorithms), as a DDP comm hook",
                         ("native", "ring", "tree", "hierarchical"))
    allreduce_local_size: int = opt(0, "allreduce = hierarchical: consecutive ranks per node (0: the processes per "
                                       "node, LOCAL_WORLD_SIZE)", minimum=0,
                                    why="ranks per node for allreduce = 'hierarchical'; 0: LOCAL_WORLD_SIZE", fix="0")

    def check(self, cfg) -> None:
        if not (0.0 < self.topk_ratio <= 1.0):
            raise ConfigError(f"parallel.topk_ratio = {self.topk_ratio} must be in (0, 1] (the share of gradient entries "
                              "sent, e.g. 0.01); set --set parallel.topk_ratio=0.01")


@keys("parallel")
class EmbeddingKeys:
    embedding_sharding: str = opt("none", "deepfm: shard embedding tables over dp ranks: none, table (whole tables) "
                                          "or row (rows of every table); the dense part stays data parallel",
                                  ("none", "table", "row"))


@keys("parallel")
class ExpertKeys:
    ep: int = opt(1, "expert-parallel degree: each MoE layer's experts split over ep data-parallel ranks "
                     "(ep divides dp and model.moe_experts); the dense part stays data parallel", minimum=1,
                  why="1: experts replicated on every rank", fix="1")


@keys("parallel")
class ContextParallelKeys:
    cp: int = opt(1, "context-parallel degree: each sequence's tokens split over cp ranks (ring attention, zig-zag "
                     "chunks so that causal attention costs every rank the same); the cp ranks see the same samples "
                     "and average gradients as dp ranks do", minimum=1, why="1: whole sequences on every rank", fix="1")


@keys("parallel")
class HeteroKeys:
    hetero: str = opt("", "data parallel on devices of unequal speed: 'auto' gives each rank a share of the global "
                          "batch proportional to its measured throughput, '1,3' fixes relative speeds; '' off")
    hetero_every: int = opt(20, "parallel.hetero = 'auto': re-measure and re-split every N steps")

    def check(self, cfg) -> None:
        if self.hetero == "auto" and self.hetero_every < cfg.data.prefetch + 2:
            raise ConfigError(f"parallel.hetero_every = {self.hetero_every} must be >= data.prefetch + 2 = "
                              f"{cfg.data.prefetch + 2}: batches are sliced that far ahead of compute")


@keys("precision")
class PrecisionKeys:
    dtype: str = opt("fp32", "compute dtype under autocast: fp32, bf16 or fp16 (fp16 uses loss scaling)", ("fp32", "bf16", "fp16"))


@keys("train")
class CheckpointingKeys:
    activation_checkpointing: bool = opt(False, "recompute each block's activations in backward to save memory")


@keys("train")
class CompileKeys:
    compile: bool = opt(False, "torch.compile each block")
