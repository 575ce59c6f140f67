"""launch.launcher = "ray": the workers as a Ray Train TorchTrainer on a local Ray cluster (the `ray_cluster`
fixture, reached through RAY_ADDRESS) end on the torchrun weights; a killed worker restarts from a checkpoint. The
fixture's readiness wait, against a stand-in for `ray`: what it reports when the head does not come up."""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from launch_helpers import plait_env, run_weights

from helpers import max_diff

RUN_S = 480  # a run through Ray Train took 183 s of plait_env's default 240 on a loaded 2-core runner


@pytest.fixture(scope="module")
def ray_run(ray_cluster, sgd_job, tmp_path_factory):
    """One run through Ray Train serves both tests below: a dp 2 job whose rank 1 is killed at step 8 and restarts
    once. Its first session is the plain run (attempt 0, no resume) that the first test checks; the restart is what
    the second one checks. (A run through Ray Train costs ~20 s alone and twice that on a loaded 2-core runner: the
    uninterrupted run the first test made before was this one's first session again.)"""
    run = tmp_path_factory.mktemp("ray-run") / "run"
    r = plait_env("train", sgd_job, "--set", "launch.launcher='ray'", "--set", "launch.max_restarts=1", "--out", run,
                  env={**ray_cluster, "PLAIT_FAULTS": "kill:rank=1:step=8"}, timeout=RUN_S)
    sessions = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"session"' in line]
    return run, r, sessions


@pytest.mark.slow
def test_dp2_under_ray_ends_on_the_torchrun_weights(ray_run, sgd_reference):
    run, r, sessions = ray_run
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 Ray Train workers on 127.0.0.1" in r.stdout
    # each plait line once per session (Ray Train's print patch would tee it), no State API chatter from Ray Train's
    # watcher
    out = re.sub(r"\x1b\[[0-9;]*m", "", r.stdout + r.stderr)  # Ray colours its "(RayTrainWorker pid=...)" prefixes
    assert len(sessions) == 2, sessions  # the first one, and the one after the restart: each says its banner once
    assert sum(1 for line in out.splitlines() if ") plait: mlp" in line) == len(sessions), out
    assert sum(1 for line in out.splitlines() if ") done: 10 steps" in line) == 1, out
    assert "Failed to query Ray Train Controller" not in out, out
    assert (sessions[0]["manager"], sessions[0]["world_size"], sessions[0]["restart_count"]) == ("ray", 2, 0)
    assert max_diff(sgd_reference, run_weights(run)) <= 1e-5


@pytest.mark.slow
def test_a_killed_ray_worker_restarts_from_the_latest_checkpoint(ray_run, sgd_reference):
    run, r, sessions = ray_run
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "resuming from" in out and "step_0000006" in out, out  # steps 7 and 8 are lost, no more
    assert [s["restart_count"] for s in sessions] == [0, 1]
    assert max_diff(sgd_reference, run_weights(run)) <= 1e-5


def fake_ray(tmp_path, fails: int) -> Path:
    """A stand-in for `ray` whose `status` fails `fails` times (printing what an unready head makes it print)."""
    count = tmp_path / "calls"
    script = tmp_path / "ray"
    script.write_text(f"""#!/bin/sh
n=$(cat {count} 2>/dev/null || echo 0); n=$((n + 1)); echo $n > {count}
if [ $n -le {fails} ]; then echo "ConnectionError: could not connect to the GCS at $2 (call $n)"; exit 1; fi
echo "Node status"
""")
    script.chmod(0o755)
    (tmp_path / "ray-start.log").write_text("Local node IP: 127.0.0.1\n")
    return script


RUNNING = SimpleNamespace(poll=lambda: None, returncode=None)


def test_the_ray_readiness_wait_polls_with_growing_pauses(ray_ready_wait, tmp_path):
    # the fixture's first pause is 0.5 s; a tenth of it here, doubling as there (3.5 s of pauses would be 0.35 s)
    took = ray_ready_wait(fake_ray(tmp_path, 3), "127.0.0.1:1", {}, RUNNING, tmp_path / "ray-start.log", budget_s=30,
                          pause_s=0.05)
    assert (tmp_path / "calls").read_text().strip() == "4"
    assert 0.05 + 0.1 + 0.2 <= took < 3  # the pauses after the three failures: 0.05, 0.1 and 0.2 s (0.5 s first: 3.5)


def test_the_ray_readiness_wait_fails_with_what_it_saw(ray_ready_wait, tmp_path):
    with pytest.raises(pytest.fail.Exception) as e:
        ray_ready_wait(fake_ray(tmp_path, 99), "127.0.0.1:1", {}, RUNNING, tmp_path / "ray-start.log", budget_s=2)
    calls = int((tmp_path / "calls").read_text())
    assert str(e.value) == (f"the local Ray cluster at 127.0.0.1:1 did not come up in 2 s ({calls} `ray status` calls; "
                            f"the last: exit 1: ConnectionError: could not connect to the GCS at --address=127.0.0.1:1 "
                            f"(call {calls}))\nray start printed:\nLocal node IP: 127.0.0.1\n")
    assert 1 <= calls <= 3  # at 0, 0.5 and 1.5 s at most (pauses of 0.5, then 1 s); a fixed 0.5 s pause would make 4


def test_the_ray_readiness_wait_stops_when_ray_start_exits(ray_ready_wait, tmp_path):
    exited = SimpleNamespace(poll=lambda: 1, returncode=1)
    with pytest.raises(pytest.fail.Exception, match=r"^ray start exited with 1 after 0 s:\nLocal node IP: 127.0.0.1\n$"):
        ray_ready_wait(fake_ray(tmp_path, 99), "127.0.0.1:1", {}, exited, tmp_path / "ray-start.log", budget_s=30)
