"""One real 2-process training run for the report tests (trackers read back, every page in Chromium)."""

import json

import pytest

from helpers import rank0_params, tiny_gpt_config


@pytest.fixture(scope="session")
def tracked_run(pool2, tiny_text, tmp_path_factory):
    """(run dir, metrics.jsonl's loss records) of 4 logged steps with an evaluation, every tracker that is installed."""
    import importlib.util

    trackers = [t for t in ("mlflow", "wandb") if importlib.util.find_spec(t)]
    run_dir = tmp_path_factory.mktemp("tracked")
    cfg = tiny_gpt_config(tiny_text, "train.steps=4", "log.every=1", "train.eval_every=2", "train.sample_tokens=0",
                          f"log.trackers={trackers!r}")
    pool2.run(rank0_params, cfg, run_dir)
    logged = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
    assert [m["step"] for m in logged] == [1, 2, 3, 4]
    return run_dir, logged
