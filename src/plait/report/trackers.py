"""Live views of a run's metrics besides metrics.jsonl (log.trackers): TensorBoard event files, an MLflow file store,
a W&B offline run, each under the run dir. Rank 0 alone writes them (the writer that has a metrics.jsonl).

Each tracker gets every numeric field of a step's record as a scalar at that step (nested dicts as name/field).
The packages are optional extras, imported only when their tracker is asked for; config checks they are installed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


class TensorBoardTracker:
    """RUN_DIR/tensorboard: event files (torch.utils.tensorboard); a resume purges the events past its step."""

    def __init__(self, run_dir: Path, keep_through: int | None, params: dict[str, str]):
        from torch.utils.tensorboard import SummaryWriter  # lazily: tensorboard is an optional extra

        self._w = SummaryWriter(log_dir=str(run_dir / "tensorboard"),
                                purge_step=None if keep_through is None else keep_through + 1)
        if params:  # the config as a text table (TensorBoard's hparams plugin needs a final metric per run)
            rows = "\n".join(f"| {k} | {v} |" for k, v in sorted(params.items()))
            self._w.add_text("config", f"| key | value |\n| --- | --- |\n{rows}", (keep_through or 0) + 1)

    def log(self, step: int, scalars: list[tuple[str, float]]) -> None:
        for key, value in scalars:
            self._w.add_scalar(key, value, step)

    def close(self) -> None:
        self._w.close()


class MLflowTracker:
    """RUN_DIR/mlruns: an MLflow file store, experiment "plait", one MLflow run per session (a resume starts another,
    tagged with its first step). Read it with `mlflow ui --backend-store-uri RUN_DIR/mlruns`."""

    def __init__(self, run_dir: Path, keep_through: int | None, params: dict[str, str]):
        # MLflow 3 keeps the file store behind this opt-in (a database store would need SQLAlchemy and a server)
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient  # lazily: mlflow is an optional extra

        self._client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
        exp = self._client.get_experiment_by_name("plait")
        exp_id = exp.experiment_id if exp else self._client.create_experiment("plait")
        tags = {"plait.run_dir": str(run_dir.resolve()), "plait.first_step": str((keep_through or 0) + 1)}
        self._run_id = self._client.create_run(exp_id, run_name=run_dir.resolve().name, tags=tags).info.run_id
        if params:
            from mlflow.entities import Param

            items = [Param(k, v[:6000]) for k, v in sorted(params.items())]
            for i in range(0, len(items), 100):  # MLflow takes at most 100 params a batch
                self._client.log_batch(self._run_id, params=items[i:i + 100])

    def log(self, step: int, scalars: list[tuple[str, float]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self._run_id, metrics=[Metric(k, float(v), now, step) for k, v in scalars])

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


class WandbTracker:
    """RUN_DIR/wandb/offline-run-*: a W&B run in offline mode (no network, no login); `wandb sync` uploads it later."""

    def __init__(self, run_dir: Path, keep_through: int | None, params: dict[str, str]):
        import wandb  # lazily: wandb is an optional extra

        settings = wandb.Settings(mode="offline", console="off", silent=True, x_disable_stats=True, disable_git=True,
                                  save_code=False)
        self._run = wandb.init(dir=str(run_dir.resolve()), project="plait", name=run_dir.resolve().name,
                               settings=settings, config={**params, "plait.first_step": (keep_through or 0) + 1},
                               reinit="create_new")

    def log(self, step: int, scalars: list[tuple[str, float]]) -> None:
        self._run.log(dict(scalars), step=step)

    def close(self) -> None:
        self._run.finish()


# log.trackers: name -> (the package it needs, its writer); the config's check and docs read the names from here.
TRACKERS = {"tensorboard": ("tensorboard", TensorBoardTracker), "mlflow": ("mlflow", MLflowTracker),
            "wandb": ("wandb", WandbTracker)}


def open_trackers(run_dir: Path, names, keep_through: int | None = None, params: dict[str, str] | None = None) -> list:
    """One tracker per name in log.trackers, in that order (names already checked by the config); each records
    `params` (the resolved config, flattened, the layout, the parameter counts) as its run's parameters."""
    return [TRACKERS[name][1](run_dir, keep_through, params or {}) for name in names]


def scalars(record: dict, prefix: str = ""):
    """(name, number) for every numeric field of a record, nested dicts as name/field (the step itself excluded)."""
    for key, value in record.items():
        if key == "step" and not prefix:
            continue
        if isinstance(value, dict):
            yield from scalars(value, f"{prefix}{key}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield f"{prefix}{key}", value
