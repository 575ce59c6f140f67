"""Starting a job: plait's own launcher, and running under the workload managers users already have.

    launch(cfg, run_dir)          # launch.launcher = "torchrun" (torchrun's elastic agent) or "ray" (Ray Train)
    job_role(cfg)                 # is this process one rank a manager started, or a launcher?  (plait.launch.role)
    resolve()                     # what the manager's variables say  (plait.launch.env, `plait env`)

The modules: env (the environment of every manager: torchrun, Slurm, Kubeflow, MPI, Ray), role (who starts
what), job (one worker: fit the config to the world, train), torchrun and raytrain (the two launchers), slurm
(`plait slurm`: job.sbatch with requeue on preemption), k8s (`plait k8s`: PyTorchJob, TrainJob, JobSet and
serving manifests), cli (those verbs) and exits (the exit statuses a worker explains itself). This file imports
no torch: `plait --help` and `plait env` stay fast.
"""

from __future__ import annotations

from pathlib import Path

from plait.config import Config
from plait.launch.env import ClusterEnv, ClusterEnvError, resolve
from plait.launch.exits import DISTRIBUTED_FAILURE_EXIT, USER_ERROR_EXIT

__all__ = ["ClusterEnv", "ClusterEnvError", "DISTRIBUTED_FAILURE_EXIT", "USER_ERROR_EXIT", "launch", "resolve"]


def launch(cfg: Config, run_dir: Path, resume: bool = False) -> int:
    """Run the job's workers on this node to completion with launch.launcher; returns the CLI's exit code."""
    if cfg.launch.launcher == "ray":
        from plait.launch.raytrain import launch_ray  # lazily: Ray is an optional extra (plait[ray])

        return launch_ray(cfg, run_dir, resume)
    from plait.launch.torchrun import launch_torchrun  # lazily: plait --help must not import torch

    return launch_torchrun(cfg, run_dir, resume)
