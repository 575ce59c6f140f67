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
from plait.refs import resolve as implementation

__all__ = ["LAUNCHERS", "ClusterEnv", "ClusterEnvError", "DISTRIBUTED_FAILURE_EXIT", "USER_ERROR_EXIT", "launch",
           "resolve"]

# launch.launcher -> what runs the job's workers on this node, (cfg, run_dir, resume) -> exit code; imported when a
# job launches (torch's elastic agent; Ray, an optional extra, only for "ray")
LAUNCHERS = {"torchrun": "plait.launch.torchrun:launch_torchrun", "ray": "plait.launch.raytrain:launch_ray"}


def launch(cfg: Config, run_dir: Path, resume: bool = False) -> int:
    """Run the job's workers on this node to completion with launch.launcher; returns the CLI's exit code."""
    return implementation(LAUNCHERS[cfg.launch.launcher])(cfg, run_dir, resume)
