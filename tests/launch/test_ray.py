"""launch.launcher = "ray": the workers as a Ray Train TorchTrainer on a local Ray cluster (the `ray_cluster`
fixture, reached through RAY_ADDRESS) end on the torchrun weights; a killed worker restarts from a checkpoint."""

import json

import pytest
from launch_helpers import plait_env, run_weights

from helpers import max_diff


@pytest.mark.slow
def test_dp2_under_ray_ends_on_the_torchrun_weights(ray_cluster, sgd_job, sgd_reference, tmp_path):
    run = tmp_path / "run"
    r = plait_env("train", sgd_job, "--set", "launch.launcher='ray'", "--out", run, env=ray_cluster)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 Ray Train workers on 127.0.0.1" in r.stdout
    session = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert (session["manager"], session["world_size"], session["restart_count"]) == ("ray", 2, 0)
    assert max_diff(sgd_reference, run_weights(run)) <= 1e-5


@pytest.mark.slow
def test_a_killed_ray_worker_restarts_from_the_latest_checkpoint(ray_cluster, sgd_job, sgd_reference, tmp_path):
    run = tmp_path / "run"
    r = plait_env("train", sgd_job, "--set", "launch.launcher='ray'", "--set", "launch.max_restarts=1", "--out", run,
                  env={**ray_cluster, "PLAIT_FAULTS": "kill:rank=1:step=8"})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "resuming from" in out and "step_0000006" in out, out  # steps 7 and 8 are lost, no more
    sessions = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"session"' in line]
    assert [s["restart_count"] for s in sessions] == [0, 1]
    assert max_diff(sgd_reference, run_weights(run)) <= 1e-5
