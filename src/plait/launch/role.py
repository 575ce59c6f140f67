"""Who starts what: is `plait train` here one rank of a job a manager started, or plait's launcher for a node?

    role = job_role(cfg)     # role.worker: train in this process; else launch(role.cfg, run_dir) on this node

| what started this process                                  | role                                            |
| ---------------------------------------------------------- | ----------------------------------------------- |
| torchrun's agent (plait's launcher or a plain torchrun)    | worker                                          |
| plait's Ray launcher                                       | worker                                          |
| srun -n N / mpirun -n N / a PyTorchJob pod per rank, N > 1 | worker (unless launch.nnodes > 1, below)        |
| the same with launch.nnodes > 1 (plait's job.sbatch: srun  | launcher for this node: launch.node_rank is the |
|   --ntasks-per-node=1 plait train ...)                     | manager's node index                            |
| a Kubeflow pod with PET_* (PyTorchJob, TrainJob, JobSet)   | launcher: launch.nnodes, node_rank, nproc per   |
|                                                            | node, the rendezvous and max_restarts are the   |
|                                                            | manager's                                       |
| nothing, or a manager's job of one process                 | launcher (the layout's workers on this machine) |

Every number the manager gives is checked against the layout before anything starts; a mismatch names both.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass

from plait.config import Config, validate_config
from plait.launch.env import ClusterEnv, ClusterEnvError, resolve
from plait.parallel.layout import Layout


@dataclass
class Role:
    env: ClusterEnv
    worker: bool  # True: this process is one rank and trains here; False: plait launches this node's workers
    cfg: Config  # the config, with the manager's placement (launch.nnodes, node_rank, ...) when a launcher


def job_role(cfg: Config, environ: Mapping[str, str] | None = None) -> Role:
    env = resolve(environ)
    if env.manager in ("torchrun", "ray"):
        return Role(env, True, cfg)
    if env.level == "node":
        return Role(env, False, node_launcher(cfg, env))
    if env.manager == "none" or env.world_size == 1:
        return Role(env, False, cfg)
    if cfg.max_nodes > 1:
        return Role(env, False, launcher_per_task(cfg, env))
    return Role(env, True, cfg)


def launcher_per_task(cfg: Config, env: ClusterEnv) -> Config:
    """launch.nnodes > 1 under srun (plait's job.sbatch): each task is one node's launcher; its node index is the manager's."""
    lo, hi = cfg.node_range
    if env.local_world_size not in (None, 1):
        raise ClusterEnvError(
            f"launch.nnodes = {cfg.launch.nnodes} runs one plait launcher per node, but {env.manager} started "
            f"{env.local_world_size} tasks on this node; start one task per node (srun --ntasks-per-node=1), or leave "
            "launch.nnodes = 1 to let every task be one rank")
    if not lo <= env.world_size <= hi:
        raise ClusterEnvError(
            f"launch.nnodes = {cfg.launch.nnodes} but {env.world_source()} = {env.world_size} launchers (one per node); "
            f"start {lo if lo == hi else f'{lo} to {hi}'} tasks, one per node, or change launch.nnodes")
    new = copy.deepcopy(cfg)
    new.launch.node_rank = env.node_rank if env.node_rank is not None else env.rank
    return new


def node_launcher(cfg: Config, env: ClusterEnv) -> Config:
    """A Kubeflow pod: the operator decides the nodes, this pod's index, processes per node and the rendezvous."""
    new = copy.deepcopy(cfg)
    lc = new.launch
    lc.nnodes = env.nnodes
    lc.node_rank = env.node_rank or 0
    lc.rdzv_endpoint = env.endpoint
    if env.rdzv_backend:
        if env.rdzv_backend not in ("c10d", "static"):
            raise ClusterEnvError(f"PET_RDZV_BACKEND={env.rdzv_backend!r}: plait's launcher supports c10d or static")
        lc.rdzv_backend = env.rdzv_backend
    if env.max_restarts is not None:
        lc.max_restarts = env.max_restarts
    layout = Layout.from_config(new)
    lo, hi = new.node_range
    if env.local_world_size:
        lc.nproc_per_node = env.local_world_size
        if lo == hi:
            layout.check_world(env.local_world_size * hi, where=f"{env.manager}'s PET_NNODES({env.nnodes}) * "
                                                                f"PET_NPROC_PER_NODE({env.local_world_size})")
    else:
        lc.nproc_per_node = 0  # "auto": the layout's processes spread over the nodes
    validate_config(new)
    layout.check_launch(hi, str(lc.nnodes), lc.nproc_per_node)
    return new


def describe(role: Role) -> str:
    """One line for `plait env`: what `plait train` would do here."""
    e = role.env
    if role.worker:
        return f"plait train here: this process trains as rank {e.rank} of {e.world_size} ({e.manager})"
    if e.manager == "none":
        return "plait train here: plait's launcher starts the layout's workers on this machine"
    return (f"plait train here: plait's launcher for node {role.cfg.launch.node_rank} of {role.cfg.launch.nnodes}, "
            f"rendezvous at {role.cfg.launch.rdzv_endpoint or e.endpoint}")
