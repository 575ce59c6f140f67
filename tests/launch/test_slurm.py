"""plait slurm: the batch script, bad flags, and jobs on a real two-node Slurm cluster on this host (the `slurm` fixture):
srun without torchrun, a job that gets USR1, checkpoints, requeues itself and resumes, and `plait cluster run
--backend slurm` (a 2-node job preempted and resubmitted on 1 node beside a short one)."""

import json
import re
import sys
import time

import pytest
from launch_helpers import cli, plait_env, run_weights

from helpers import max_diff
from plait.config import load_config
from plait.errors import ConfigError
from plait.launch.slurm import parse_time
from plait.parallel.layout import Layout


def test_plait_slurm_writes_the_batch_script(sgd_job, tmp_path):
    run = tmp_path / "run"
    code, out, err = cli("slurm", sgd_job, "--nodes", "2", "--gpus-per-node", "0", "--cpus-per-task", "4", "--time",
                         "01:30:00", "--partition", "gpu", "--account", "proj-1", "--set", "train.steps=20", "--out", run)
    assert code == 0, err
    script = (run / "job.sbatch").read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --cpus-per-task=4", "#SBATCH --time=01:30:00",
                 "#SBATCH --partition=gpu", "#SBATCH --account=proj-1", "#SBATCH --requeue", "#SBATCH --signal=B:USR1@120",
                 'scontrol requeue "$SLURM_JOB_ID"', "trap 'stop USR1' USR1", "trap 'stop SIGTERM' TERM",
                 "MASTER_PORT:-$((15000 + SLURM_JOB_ID % 10000))", 'train --resume "$RUN_DIR"',
                 'launch.rdzv_endpoint=$MASTER_ADDR:$MASTER_PORT'):
        assert line in script, line
    assert "--gpus-per-node" not in script
    assert 'steps = 20' in (run / "config.toml").read_text()
    assert "sbatch" in out
    code, out, err = cli("slurm", sgd_job, "--nodes", "1", "--gpus-per-node", "2", "--cpus-per-task", "8", "--time",
                         "2-00:00:00", "--out", tmp_path / "gpu")
    assert code == 0, err
    assert "#SBATCH --gpus-per-node=2" in (tmp_path / "gpu" / "job.sbatch").read_text()


def test_the_readme_job_fills_the_allocation_unless_dp_is_pinned(tmp_path):
    """issue 38 item 5: the README's job.toml (dp = 2) with --nodes 2 --gpus-per-node 8: dp follows, batch kept."""
    code, out, _ = cli("config", "show")
    (tmp_path / "job.toml").write_text(out)
    code, out, err = cli("slurm", tmp_path / "job.toml", "--nodes", "2", "--gpus-per-node", "8", "--cpus-per-task",
                         "32", "--time", "04:00:00", "--out", tmp_path / "a")
    assert code == 0, err
    assert err.strip() == ("parallel.dp 2 -> 16 to fill --nodes 2 x --gpus-per-node 8 (16 processes / tp 1 x pp 1), "
                           "train.micro_batch_size 16 -> 2 (the global batch kept); pin it with --set parallel.dp=N")
    config = (tmp_path / "a" / "config.toml").read_text()
    assert "\ndp = 16\n" in config and "\nglobal_batch_size = 32\n" in config and "\nnproc_per_node = 8\n" in config


@pytest.mark.parametrize("axis", ["cp", "tp", "pp"])
def test_a_cp2_tp2_or_pp2_job_keeps_its_degrees_and_its_process_count(tmp_path, axis):
    """issue 56 item 5: a job file's dp = 1 with cp, tp or pp = 2 on 2 GPUs stays as it is (dp = 2, four processes,
    before for cp); on twice the GPUs dp alone doubles (Layout.resolve)."""
    (tmp_path / "job.toml").write_text(f"[parallel]\ndp = 1\n{axis} = 2\n")
    per = {"cp": "cp 2 x tp 1 x pp 1", "tp": "tp 2 x pp 1", "pp": "tp 1 x pp 2"}[axis]
    for nodes, dp, note in ((1, 1, ""), (2, 2, f"parallel.dp 1 -> 2 to fill --nodes 2 x --gpus-per-node 2 (4 processes "
                                                f"/ {per}); pin it with --set parallel.dp=N")):
        run = tmp_path / f"n{nodes}"
        code, _, err = cli("slurm", tmp_path / "job.toml", "--nodes", nodes, "--gpus-per-node", "2", "--cpus-per-task", "1",
                           "--time", "00:10:00", "--out", run)
        assert code == 0, err
        assert err.strip() == note
        cfg = load_config(run / "config.toml")
        assert (cfg.parallel.dp, getattr(cfg.parallel, axis), cfg.launch.nproc_per_node) == (dp, 2, 2)
        assert Layout.from_config(cfg).world_size == 2 * nodes
        script = (run / "job.sbatch").read_text()
        assert f"#SBATCH --nodes={nodes}\n" in script and "#SBATCH --gpus-per-node=2\n" in script


@pytest.mark.parametrize("flags, message", [
    (["--nodes", "0"], "argument --nodes: 0 must be >= 1"),
    (["--time", "25:61:00"], "argument --time: --time '25:61:00' is not a time limit Slurm accepts"),
    (["--time", "1-24:00:00"], "argument --time: --time '1-24:00:00' is not a time limit"),
    (["--time", "00:00:00"], "--time '00:00:00' is zero"),
    (["--time", "four hours"], "argument --time"),
    (["--cpus-per-task", "0"], "argument --cpus-per-task: 0 must be >= 1"),
    (["--partition", "gpu nodes"], "--partition 'gpu nodes'"),
    (["--time", "00:01:00"], "--grace 120 s must be > 0 and shorter than --time 00:01:00"),
    (["--nodes", "3"], "cannot be split evenly over launch.nnodes = --nodes 3"),
    (["--gpus-per-node", "4", "--set", "parallel.dp=2"], "nproc_per_node(4) * nnodes(2) = 8"),  # dp pinned
])
def test_bad_slurm_flags_exit_2_naming_the_flag(sgd_job, tmp_path, flags, message):
    base = {"--nodes": "2", "--cpus-per-task": "1", "--time": "00:10:00"}
    args = []
    for k, v in base.items():
        if k not in flags:
            args += [k, v]
    code, out, err = cli("slurm", sgd_job, *args, *flags, "--out", tmp_path / "run")
    assert code == 2, out + err
    assert message in err, err
    assert not (tmp_path / "run" / "job.sbatch").exists()


@pytest.mark.parametrize("text, seconds", [("10", 600), ("10:30", 630), ("04:00:00", 14400), ("1-00", 86400),
                                           ("1-02:03", 93780), ("2-00:00:01", 172801), ("100:00:00", 360000)])
def test_slurm_time_forms(text, seconds):
    assert parse_time(text) == seconds


def test_bad_times_are_config_errors():
    for text in ("", "1:2:3:4", "00:60", "1-24", "-5", "1h"):
        with pytest.raises(ConfigError, match="--time"):
            parse_time(text)


# ---- on a real Slurm cluster


def _submit(slurm, job, run, *extra, env=None) -> str:
    r = plait_env("slurm", job, "--nodes", "2", "--cpus-per-task", "1", "--time", "00:10:00", "--out", run, "--submit", *extra,
                  env=env or slurm.env)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.split("submitted job ")[1].split()[0]


def _wait_done(slurm, job: str, out, timeout: float, release: bool = False) -> None:
    """Until the job has left the queue and its output says it finished (a busy slurmctld may answer late).
    release: a requeued job still pending is asked to start now every few seconds (Slurm holds one ~120 s, and an
    update sent while it was still being requeued can be lost)."""
    deadline, asked = time.time() + timeout, time.time()
    while time.time() < deadline:
        if out.is_file() and "done: 10 steps" in out.read_text() and slurm.state(job) == "":
            return
        if out.is_file() and "Traceback" in out.read_text() and slurm.state(job) == "":
            break
        if release and time.time() - asked > 5 and slurm.state(job) == "PENDING":
            slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now", check=False)
            asked = time.time()
        time.sleep(0.3)
    slurm.wait_gone(job, 10)


def test_srun_without_torchrun_forms_one_job_from_slurms_variables(slurm, sgd_job, sgd_reference, tmp_path):
    env = {**slurm.env, "MASTER_ADDR": "127.0.0.1"}  # the test cluster's node names n1, n2 do not resolve
    r = slurm.run("srun", "-N2", "-n2", sys.executable, "-m", "plait", "train", str(sgd_job), "--out", str(tmp_path / "run"),
                  env=env, timeout=120, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert max_diff(sgd_reference, run_weights(tmp_path / "run")) <= 1e-5
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert (first["event"], first["manager"], first["world_size"]) == ("session", "slurm", 2)
    # Slurm gives 3 tasks, the layout needs 2: every task stops before training, naming both numbers
    r = slurm.run("srun", "-N2", "-n3", sys.executable, "-m", "plait", "train", str(sgd_job), "--out", str(tmp_path / "bad"),
                  env=env, timeout=120, check=False)
    assert r.returncode != 0
    assert "the layout needs dp(2) * tp(1) * pp(1) = 2 processes but Slurm's SLURM_NTASKS = 3" in r.stderr, r.stderr
    assert not (tmp_path / "bad" / "checkpoints").exists()


@pytest.mark.slow
def test_usr1_checkpoints_requeues_and_resumes_on_the_same_weights(slurm, sgd_job, sgd_reference, tmp_path):
    t0 = time.monotonic()
    run = tmp_path / "run"
    # every rank waits at step 3 until it is asked to stop: the signal finds the job training however loaded the
    # machine, and neither incarnation sleeps through its steps (the requeued one resumes past step 3)
    job = _submit(slurm, sgd_job, run, env={**slurm.env, "PLAIT_FAULTS": "stall:step=3:until=stop:seconds=60"})
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 90
    while time.time() < deadline:
        if metrics.is_file() and sum('"loss"' in line for line in metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"job {job} never logged 2 steps: {slurm.exit_code(job)}")
    slurm.run("scancel", "--batch", "--signal=USR1", job)  # what --signal=B:USR1@120 does before the time limit
    deadline = time.time() + 90
    while slurm.state(job) != "PENDING" and time.time() < deadline:
        time.sleep(0.2)
    assert slurm.state(job) == "PENDING", slurm.exit_code(job)
    assert "Restarts=1" in slurm.exit_code(job)
    # Slurm holds a requeued job ~120 s; release it sooner, but not within the second of the requeue: a credential
    # issued in the same second as the old one's revocation counts as revoked and the restart is killed
    time.sleep(2.5)
    slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    out = run / f"slurm-{job}.out"
    _wait_done(slurm, job, out, 150, release=True)  # the requeued job runs to its end and leaves the queue
    wall = time.monotonic() - t0
    log = out.read_text()
    assert "USR1: stopping at the next logging step" in log and "requeueing" in log, log
    assert "preempted (SIGTERM): stopped cleanly at step_" in log, log
    assert "resuming from" in log and "done: 10 steps" in log, log
    sessions = [json.loads(line) for line in metrics.read_text().splitlines() if '"session"' in line]
    assert [s["slurm_restart_count"] for s in sessions] == [0, 1]
    assert max_diff(sgd_reference, run_weights(run)) <= 1e-5
    print(f"\nSlurm requeue test: {wall:.1f} s from sbatch to the end of the requeued job")


# The long job's 2-node run waits at step 3 until it is preempted (the signal finds it training, however loaded the
# machine); the 1-node runs (the short job's, the long one's second) take >= 0.5 s a step: the long one ends last.
FAULTS = "stall:step=3:world=2:until=stop:seconds=60;slow:seconds=0.5:world=1"


def test_cluster_run_on_slurm_preempts_resizes_and_keeps_the_trajectory(slurm, sgd_job, sgd_reference, tmp_path):
    """`plait cluster run --backend slurm --policy srtf` on the two-node cluster: the long job starts on both nodes;
    the short one arrives, the long one gets USR1 (checkpoint, end, no requeue) and is resubmitted on one node beside
    the short one, which finishes first. The long job's weights are its 2-process run's."""
    jobs = tmp_path / "jobs.toml"
    jobs.write_text(f'[[job]]\nname = "long"\nconfig = "{sgd_job}"\nmin_procs = 1\nmax_procs = 2\n\n'
                    f'[[job]]\nname = "short"\nconfig = "{sgd_job}"\nset = ["train.steps=1", "parallel.dp=1"]\n'
                    'arrival = 3\n')
    out = tmp_path / "cluster"
    r = plait_env("cluster", "run", jobs, "--backend", "slurm", "--slots", "2", "--policy", "srtf", "--time", "00:10:00",
                  "--poll", "0.3", "--out", out, env={**slurm.env, "PLAIT_FAULTS": FAULTS}, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((out / "cluster.json").read_text())
    rows = {j["job"]: j for j in summary["jobs"]}
    assert rows["long"]["preemptions"] == 1 and rows["long"]["procs"] == [1, 2], rows
    assert rows["short"]["preemptions"] == 0 and rows["short"]["procs"] == [1], rows
    starts = [e for e in summary["events"] if e["event"] == "start"]
    assert [(e["job"], e["procs"]) for e in starts] == [("long", 2), ("short", 1), ("long", 1)], starts
    assert len({e["slurm_job_id"] for e in starts}) == 3
    finish = {e["job"]: e["t"] for e in summary["events"] if e["event"] == "finish"}
    assert finish["short"] < finish["long"]
    assert max_diff(sgd_reference, run_weights(out / "jobs" / "long")) <= 1e-5
    sessions = [json.loads(x) for x in (out / "jobs" / "long" / "metrics.jsonl").read_text().splitlines()
                if '"session"' in x]
    assert [s["world_size"] for s in sessions] == [2, 1] and all(s["slurm_restart_count"] == 0 for s in sessions)


def test_a_run_dir_or_job_values_that_would_escape_the_sbatch_lines_are_refused(sgd_job, tmp_path):
    """Issue 37 N10: the run dir went unquoted into #SBATCH lines; `plait cluster run --backend slurm` took any --time
    and --partition. Nothing is written or submitted."""
    from plait.cluster.run import JobSpec, SlurmQueue
    from plait.errors import ConfigError

    evil = tmp_path / "run\nrm -rf ~"
    code, out, err = cli("slurm", sgd_job, "--nodes", "2", "--cpus-per-task", "1", "--time", "00:10:00", "--out", evil)
    assert code == 2 and "a Slurm job script names the run dir in #SBATCH lines, which cannot quote '\\n', ' '" in err, err
    assert not (evil / "job.sbatch").exists()
    spec = [JobSpec("a", str(sgd_job), [], 0.0, 1, 2, 4, 1)]
    for kw, message in (({"time_limit": "soon"}, "--time 'soon' is not a time limit"),
                        ({"partition": "gpu\n#SBATCH --x"}, "--partition 'gpu\\n#SBATCH --x': Slurm names are")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            SlurmQueue(spec, 2, "fifo", tmp_path / "q", **kw)
    assert not (tmp_path / "q" / "jobs").exists()
