"""The [launch] section: how many processes on how many machines, and the "auto" values the machine decides.

Torch-free; `LaunchKeys.resolve` replaces launch.nproc_per_node = "auto" and parallel.dp = "auto" by
numbers when the config loads (load_config calls it), before anything launches.
"""

from __future__ import annotations

from plait.config import derived, keys, note_auto, opt
from plait.errors import ConfigError
from plait.parallel.layout import Layout, dedicated_servers, replica_procs


@keys("launch")
class LaunchKeys:
    nproc_per_node: int | str = opt(0, "worker processes on this machine; 0 = what the layout needs; \"auto\": every "
                                       "local GPU (on CPU: what the layout needs)", minimum=0)
    nnodes: str = opt("1", "machines in the job: N, or MIN:MAX for an elastic job that goes on with MIN to MAX",
                      accepts=(int,))
    node_rank: int = opt(0, "this machine's index in the job (0 hosts the rendezvous)", minimum=0)
    rdzv_endpoint: str = opt("", "host:port of the rendezvous (node 0); empty for a single machine")
    local_addr: str = opt("", "this machine's address as the others reach it (default: node 0 takes the host of "
                              "rdzv_endpoint, other nodes their hostname)")
    rdzv_backend: str = opt("c10d", "torchrun rendezvous backend: c10d or static", ("c10d", "static"))
    max_restarts: int = opt(0, "times torchrun's agent restarts failed workers", minimum=0)
    on_resize: str = opt("dp", "an elastic job whose world size changed: dp (keep tp and pp, adapt data parallelism) "
                               "or replan (when tp x pp or the batch no longer divides, the fastest fitting layout "
                               "plait plan finds for the new size)", ("dp", "replan"))
    heartbeat_s: int = opt(5, "elastic jobs (c10d rendezvous): seconds between a node's heartbeats; a node silent for "
                              "3 of them is dropped and the others re-form without it", minimum=1)
    launcher: str = opt("torchrun", "what starts the workers: torchrun (its elastic agent) or ray (a Ray Train TorchTrainer "
                                    "on RAY_ADDRESS or a local Ray cluster; the ray extra)", ("torchrun", "ray"))
    backend: str = opt("auto", "process-group backend: auto (nccl on CUDA, else gloo), gloo or nccl", ("auto", "gloo", "nccl"))
    device: str = opt("auto", "auto (cuda when available, else cpu), cpu or cuda", ("auto", "cpu", "cuda"))
    timeout_s: int = opt(300, "seconds a collective may wait before it is an error naming the ranks that did not join",
                         minimum=1)
    device_hour_cost: float = opt(0.0, "the price of one device (process) for one hour, any currency: summary.json "
                                       "and the report give the run's cost and its cost to train.target (0: none)",
                                  minimum=0, finite=True)
    check_collectives: bool = opt(False, "fingerprint every collective and compare across ranks (slower; finds the "
                                         "mismatch behind a hang)")

    def check(self, cfg) -> None:
        if cfg.max_nodes > 1 and not self.rdzv_endpoint:
            raise ConfigError(f"launch.nnodes = {self.nnodes} needs launch.rdzv_endpoint = 'host:port' of node 0 "
                              "(e.g. --set launch.rdzv_endpoint=10.0.0.1:29500)")
        if self.node_rank >= cfg.max_nodes:
            raise ConfigError(f"launch.node_rank = {self.node_rank} must be < launch.nnodes = {self.nnodes}")
        if self.rdzv_endpoint and ":" not in self.rdzv_endpoint:
            raise ConfigError(f"launch.rdzv_endpoint = {self.rdzv_endpoint!r} must be host:port, e.g. 10.0.0.1:29500")

    @staticmethod
    def resolve(cfg, gpus: int | None = None) -> list[str]:
        """launch.nproc_per_node = "auto" and parallel.dp = "auto" as numbers; what was decided, in words.

        nproc_per_node: every local GPU, or on CPU 0 (the layout's need). dp: Layout.resolve of the job's processes
        (nproc_per_node, else the GPUs, times the machines): minus parameter servers, divided by cp x tp x pp; on CPU
        without nproc_per_node, 1. gpus: the local GPU count (default: local_gpus()).
        """
        lc, p = cfg.launch, cfg.parallel
        if not (isinstance(p.dp, str) or isinstance(lc.nproc_per_node, str)):
            return []
        for key, value in (("launch.nproc_per_node", lc.nproc_per_node), ("parallel.dp", p.dp)):
            if isinstance(value, bool) or not isinstance(value, int) and value != "auto":
                raise ConfigError(f"{key} = {value!r} must be a whole number or \"auto\"; e.g. --set {key}=auto")
        gpus = local_gpus(lc.device) if gpus is None else gpus
        notes = []
        if lc.nproc_per_node == "auto":
            lc.nproc_per_node = gpus
            notes.append(f"launch.nproc_per_node = auto -> {gpus} (every local GPU)" if gpus else
                         "launch.nproc_per_node = auto -> 0: no GPU here, the layout's processes")
        if p.dp == "auto":
            notes.append(_auto_dp(cfg, lc.nproc_per_node or gpus))
        note_auto(cfg, notes)
        return notes


def _auto_dp(cfg, per_node: int) -> str:
    """Set parallel.dp from the processes there are (Layout.resolve); the note saying how."""
    p, nodes = cfg.parallel, cfg.max_nodes
    if not per_node:
        p.dp = 1
        return ("parallel.dp = auto -> 1: no GPU here and launch.nproc_per_node is not set (set it to the processes to "
                "fill)")
    servers = dedicated_servers(cfg)
    try:
        layout = Layout.resolve(cfg, per_node * nodes, f"launch.nproc_per_node({per_node}) * nnodes({nodes})")
    except ConfigError as e:
        raise ConfigError(f"parallel.dp = auto: {e}; or set parallel.dp to a number") from None
    p.dp = layout.dp * layout.members
    what = (f"{per_node} process{'es' * (per_node > 1)} per machine" + (f" x {nodes} machines" if nodes > 1 else "")
            + (f" - {servers} parameter servers" if servers else ""))
    per = (f"cp {p.cp} x " if p.cp > 1 else "") + f"tp {p.tp} x pp {p.pp}"
    return f"parallel.dp = auto -> {p.dp} ({what}" + (f" / {per}" if replica_procs(cfg) > 1 else "") + ")"


def local_gpus(device: str = "auto") -> int:
    """GPUs on this machine that launch.device lets plait use (0 on CPU or with launch.device = 'cpu')."""
    if device == "cpu":
        return 0
    import torch  # lazily: only an "auto" asks, and plait --help must not import torch

    return torch.cuda.device_count()


@derived("node_range")
def node_range(cfg) -> tuple[int, int]:
    """cfg.node_range: (min, max) machines; launch.nnodes = "N" gives (N, N), "MIN:MAX" an elastic range."""
    text = str(cfg.launch.nnodes).strip()
    try:
        lo, _, hi = text.partition(":")
        lo_n, hi_n = int(lo), int(hi or lo)
    except ValueError:
        raise ConfigError(f"launch.nnodes = {text!r} must be N or MIN:MAX, e.g. 2 or '1:2'") from None
    if not 1 <= lo_n <= hi_n:
        raise ConfigError(f"launch.nnodes = {text!r}: need 1 <= MIN <= MAX")
    return lo_n, hi_n


@derived("max_nodes")
def max_nodes(cfg) -> int:
    """cfg.max_nodes: the most machines the job may have."""
    return node_range(cfg)[1]


@derived("elastic")
def elastic(cfg) -> bool:
    """cfg.elastic: whether the world may change size while the job runs (fewer nodes, or restarts after failures)."""
    lo, hi = node_range(cfg)
    return lo < hi or cfg.launch.max_restarts > 0
