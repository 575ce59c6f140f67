"""`plait cluster run`: three real jobs on two process slots under srtf. The long job starts on both slots; the short
and the medium ones arrive and preempt it (once it has trained a step: before, it has nothing to checkpoint); when the
first of them ends, the long one resumes on the slot left, one process instead of two (migration and resizing). The long
job finishes last, and every job ends on its solo trajectory. (Which of short and medium ends first is left to the
clock: they run side by side, one slot each, and under load their start-up can outweigh the 54 steps between them;
what the test needs is that they do not end together.)"""

from __future__ import annotations

import json

import pytest

from helpers import params_after, plait
from plait.config import load_config

BASE = ["model.name=mlp", "data.name=digits", "model.width=16", "train.global_batch_size=16",
        "train.micro_batch_size=8", "train.eval_samples=32", "log.every=1", "log.progress=false", "log.report=false",
        "optim.name=sgd", "optim.momentum=0", "optim.lr=0.05", "optim.schedule=constant", "optim.warmup_steps=0"]
# arrival, min, max procs, steps. Medium has 54 steps (>= 2.7 s at 50 ms a step) more than short: with 24 it once ended
# 70 ms before short under load, both within one poll, and the long job came back on both slots.
JOBS = {"long": (0.0, 1, 2, 120), "short": (1.0, 1, 1, 6), "medium": (1.0, 1, 1, 60)}


def losses(run) -> list[float]:
    return [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("cluster")
    text = ""
    for name, (arrival, lo, hi, steps) in JOBS.items():
        sets = ", ".join(f'"{s}"' for s in [*BASE, f"train.steps={steps}"])
        text += (f'[[job]]\nname = "{name}"\nset = [{sets}]\narrival = {arrival}\nmin_procs = {lo}\n'
                 f"max_procs = {hi}\n\n")
    (d / "jobs.toml").write_text(text)
    r = plait("cluster", "run", d / "jobs.toml", "--slots", "2", "--policy", "srtf", "--poll", "0.2",
              "--out", d / "out", timeout=400,
              faults="slow:seconds=0.05")  # every step takes >= 50 ms: the long job is still training when preempted
    assert r.returncode == 0, r.stdout + r.stderr
    return d / "out", r.stdout


@pytest.mark.slow
def test_the_short_job_preempts_the_long_one_which_resumes_resized_on_its_solo_trajectory(cluster_run, tmp_path):
    from plait.export import load_run_checkpoint

    out, stdout = cluster_run
    summary = json.loads((out / "cluster.json").read_text())
    jobs = {j["job"]: j for j in summary["jobs"]}
    finish = {e["job"]: e["t"] for e in summary["events"] if e["event"] == "finish"}
    assert max(finish["short"], finish["medium"]) < finish["long"], finish
    assert jobs["long"]["preemptions"] == 1 and jobs["short"]["preemptions"] == jobs["medium"]["preemptions"] == 0
    starts = [e["procs"] for e in summary["events"] if e["job"] == "long" and e["event"] == "start"]
    assert starts == [2, 1], summary["events"]  # resized when it came back
    back = [e["t"] for e in summary["events"] if e["job"] == "long" and e["event"] == "start"][1]
    assert back >= min(finish["short"], finish["medium"]), summary["events"]  # on the slot the first to end left
    assert (out / "gantt.png").stat().st_size > 5000 and "makespan" in stdout
    for name, (_, _, _, steps) in JOBS.items():
        cfg = load_config(None, [*BASE, f"train.steps={steps}", "parallel.dp=1"])
        solo = params_after(cfg, tmp_path / name)
        run = out / "jobs" / name
        got = load_run_checkpoint(run)[2].state_dict()
        assert max(float((got[k] - solo[k]).abs().max()) for k in solo) <= 1e-5, name
        # per-step loss: the run's metrics (cut at the resumed step, so no step twice) against the solo run's
        assert losses(run) == pytest.approx(losses(tmp_path / name), abs=1e-5), name
    assert json.loads((out / "jobs" / "long" / "summary.json").read_text())["steps"] == JOBS["long"][3]


def test_a_job_folder_holding_your_files_is_refused_before_anything_starts(tmp_path):
    """Issue 37 N9: starting a job afresh cleared OUT/jobs/<name>, a file of yours included."""
    from plait.cluster.run import JobSpec, LocalCluster
    from plait.errors import ConfigError

    mine = tmp_path / "out" / "jobs" / "a"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("precious")
    cluster = LocalCluster([JobSpec("a", None, [], 0.0, 1, 1, 4, 1)], 1, "fifo", tmp_path / "out")
    with pytest.raises(ConfigError, match=r"the folder of job 'a', .*jobs/a is a folder that holds other files and is "
                                          "not a plait run"):
        cluster.run(timeout=5)
    assert (mine / "notes.txt").read_text() == "precious"
