"""launch.launcher = "ray": the job's workers as a Ray Train TorchTrainer, on an existing Ray cluster or a local one.

    RAY_ADDRESS=ray://head:10001 plait train job.toml --set launch.launcher=ray --out /shared/runs/a
    plait train job.toml --set launch.launcher=ray                 # no RAY_ADDRESS: a local Ray cluster

Ray Train starts one worker per process of the layout and forms the torch process group (gloo on CPU, NCCL
with GPUs); each worker then runs the same code as under torchrun (plait.launch.job), its rank read from the
PLAIT_RAY_* variables set here (plait.launch.env). A worker that dies makes Ray restart the whole group, up to
launch.max_restarts times (Ray's FailureConfig.max_failures); the new group resumes from the run's latest
checkpoint, so the run dir must be on storage every Ray node sees (any path works on a local cluster).
Needs the ray extra (Ray Train; it does not bring its own torch): plait.extras.install_command('ray').
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import torch

from plait.config import Config
from plait.errors import ConfigError, PlaitError
from plait.extras import install_command
from plait.parallel.layout import Layout

FORWARDED = ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "PYTHONUNBUFFERED")


def _import_ray():
    try:
        import ray
        import ray.train  # noqa: F401
        import ray.train.torch  # noqa: F401
    except ImportError:
        raise ConfigError(f"launch.launcher = 'ray' needs Ray Train: {install_command('ray')} "
                          "(or set launch.launcher='torchrun')") from None
    return ray


def worker_env(cfg: Config, local_cluster: bool) -> dict[str, str]:
    """What the Ray workers must see: plait's own variables (PLAIT_FAULTS, PLAIT_TRUST_CHECKPOINT, ...) and thread or
    interface settings; on a local cluster loopback for gloo, as plait's torchrun launcher does on one machine."""
    env = {k: v for k, v in os.environ.items() if k.startswith("PLAIT_") or k in FORWARDED}
    if local_cluster and "GLOO_SOCKET_IFNAME" not in env and cfg.launch.backend != "nccl":
        env["GLOO_SOCKET_IFNAME"] = "lo"
    env.setdefault("OMP_NUM_THREADS", "1")
    # Ray Train sends a worker's print() to its logger and, as Ray's workers' stdout is not sys.__stdout__, to the
    # stream as well: every line of plait's would reach the console twice
    env.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    return env


def _train_loop(config: dict) -> None:
    """Runs in every Ray Train worker: say who we are in PLAIT_RAY_*, then train as any plait worker does."""
    import ray  # lazily: Ray is an optional extra; this runs in Ray's worker processes
    import ray.train

    from plait.launch.job import run_worker_dir  # in the Ray worker process: this function is shipped there and imports it there

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    attempt = ray.get(config["attempts"].start.remote(rank))  # 0 on the first start, then 1, 2, ... after restarts
    os.environ.update({
        "PLAIT_RAY_RANK": str(rank), "PLAIT_RAY_WORLD_SIZE": str(ctx.get_world_size()),
        "PLAIT_RAY_LOCAL_RANK": str(ctx.get_local_rank()), "PLAIT_RAY_LOCAL_WORLD_SIZE": str(ctx.get_local_world_size()),
        "PLAIT_RAY_NODE_RANK": str(ctx.get_node_rank()), "PLAIT_RAY_RUN": config["run_id"],
        "PLAIT_RESTART_COUNT": str(attempt),
    })
    if os.path.isdir(config["cwd"]):
        os.chdir(config["cwd"])  # relative paths in the config (data.path) mean what they meant where plait train ran
    try:
        run_worker_dir(Path(config["run_dir"]), resume=config["resume"] or attempt > 0, own_process_group=False)
    except PlaitError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        raise


def launch_ray(cfg: Config, run_dir: Path, resume: bool = False) -> int:
    ray = _import_ray()
    from ray.train import FailureConfig, RunConfig, ScalingConfig  # lazily: Ray is an optional extra
    from ray.train.torch import TorchConfig, TorchTrainer

    layout = Layout.from_config(cfg)
    if layout.ps:
        raise ConfigError("launch.launcher = 'ray' runs the layout's ranks in one torch process group; a parameter server "
                          "(parallel.sync = 'ps') talks RPC: use launch.launcher='torchrun'")
    world = layout.world_size
    run_dir = run_dir.resolve()
    address = os.environ.get("RAY_ADDRESS", "")
    local = not address
    env = worker_env(cfg, local)
    use_gpu = cfg.launch.device == "cuda" or (cfg.launch.device == "auto" and _cuda())
    # plait.quiet's filters in every Ray worker process (the train workers and Ray Train's own actors)
    init = {"runtime_env": {"env_vars": env, "worker_process_setup_hook": "plait.quiet.install"},
            "log_to_driver": True, "configure_logging": False}
    if local:
        init.update(num_cpus=max(world, os.cpu_count() or 1), include_dashboard=False)
    ray.init(**init) if not ray.is_initialized() else None

    @ray.remote(num_cpus=0)
    class Attempts:
        def __init__(self):
            self.starts: dict[int, int] = {}

        def start(self, rank: int) -> int:
            n = self.starts.get(rank, 0)
            self.starts[rank] = n + 1
            return n

    attempts = Attempts.remote()
    trainer = TorchTrainer(
        _train_loop,
        train_loop_config={"run_dir": str(run_dir), "resume": resume, "cwd": os.getcwd(), "attempts": attempts,
                           "run_id": f"{run_dir.name}-{uuid.uuid4().hex[:8]}"},
        torch_config=TorchConfig(backend=None if cfg.launch.backend == "auto" else cfg.launch.backend,
                                 timeout_s=cfg.launch.timeout_s),
        scaling_config=ScalingConfig(num_workers=world, use_gpu=use_gpu, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=f"plait-{run_dir.name}", storage_path=str(run_dir / "ray"),
                             failure_config=FailureConfig(max_failures=cfg.launch.max_restarts)),
    )
    print(f"plait: {world} Ray Train worker{'s' if world > 1 else ''} on "
          f"{address or 'a local Ray cluster'} (max restarts {cfg.launch.max_restarts})", flush=True)
    try:
        trainer.fit()
    except Exception as e:  # Ray wraps the workers' errors; say the first line and exit like the torchrun launcher
        text = str(e).strip()
        user = "PlaitError" in text or "ConfigError" in text or "CheckpointError" in text
        print(f"error: the Ray Train job failed: {text.splitlines()[0] if text else type(e).__name__}"
              + ("" if user else f"\n{text[-4000:]}"), file=sys.stderr)
        return 2 if user else 1
    finally:
        ray.shutdown()  # a local cluster stops; an existing one is only disconnected
    return 0


def _cuda() -> bool:
    return torch.cuda.is_available()
