"""`plait slurm`: a batch script that runs a plait job on a Slurm cluster and survives preemption and time limits.

    write_job(cfg, SlurmJob(nodes=2, gpus_per_node=8, cpus_per_task=32, time="04:00:00"), run_dir)
        -> RUN_DIR/config.toml (the resolved config) and RUN_DIR/job.sbatch
    submit(run_dir) -> the job id (sbatch --parsable)

The job: one task per node; each task is plait's launcher (torchrun's elastic agent) for its node, meeting
the others in a c10d rendezvous on the first node (its NodeAddr, port 15000 + the job id's last four digits,
as Lightning derives it). Every start is `plait train --resume RUN_DIR`, so a requeued job continues from
checkpoints/latest (and a fresh one starts at step 0).

Preemption: `#SBATCH --signal=B:USR1@GRACE` has Slurm send USR1 to the batch shell GRACE seconds before the
time limit (`scancel --batch --signal=USR1` does the same by hand). On USR1, or on SIGTERM, the script sends
SIGTERM to the job step; every rank stops at the next logging step, the job writes a checkpoint and the
launchers exit 0 (plait.train.watchdog); then the script runs `scontrol requeue $SLURM_JOB_ID`
(`#SBATCH --requeue`). The requeued job sees SLURM_RESTART_COUNT (noted in metrics.jsonl).
"""

from __future__ import annotations

import copy
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from plait.config import Config, dump_config
from plait.errors import ConfigError, PlaitError
from plait.parallel.layout import Layout

DEFAULT_GRACE_S = 120  # USR1 this long before the time limit: a logging step plus a checkpoint must fit


@dataclass
class SlurmJob:
    nodes: int
    time: str  # Slurm's --time: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS
    cpus_per_task: int = 0  # 0: Slurm's default
    gpus_per_node: int = 0
    partition: str = ""
    account: str = ""
    grace_s: int = DEFAULT_GRACE_S
    job_name: str = ""
    requeue: bool = True  # False: on USR1/SIGTERM checkpoint and end (`plait cluster run` resubmits it itself)


def parse_time(text: str) -> int:
    """Seconds in a Slurm --time value; raises ConfigError naming --time for what sbatch would reject."""
    t = text.strip()
    fail = ConfigError(f"--time {text!r} is not a time limit Slurm accepts: use HH:MM:SS (e.g. 04:00:00), MM, MM:SS, "
                       "D-HH, D-HH:MM or D-HH:MM:SS, with minutes and seconds below 60 and hours below 24 after a day")
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", t)
    if m is None:
        raise fail
    days, a, b, c = m.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        h, mi, s = int(a), int(b or 0), int(c or 0)
        if h >= 24 or mi >= 60 or s >= 60:
            raise fail
        seconds = int(days) * 86400 + h * 3600 + mi * 60 + s
    elif c is not None:  # HH:MM:SS
        h, mi, s = int(a), int(b), int(c)
        if mi >= 60 or s >= 60:
            raise fail
        seconds = h * 3600 + mi * 60 + s
    elif b is not None:  # MM:SS
        if int(b) >= 60:
            raise fail
        seconds = int(a) * 60 + int(b)
    else:  # MM
        seconds = int(a) * 60
    if seconds <= 0:
        raise ConfigError(f"--time {text!r} is zero: give the job a time limit, e.g. --time 04:00:00")
    return seconds


def check_name(flag: str, value: str) -> str:
    if value and not re.fullmatch(r"[A-Za-z0-9_.:+-]+", value):
        raise ConfigError(f"{flag} {value!r}: Slurm names are letters, digits and _ . : + - (no spaces)")
    return value


def check_job(job: SlurmJob) -> None:
    for flag, value in (("--nodes", job.nodes), ("--cpus-per-task", job.cpus_per_task + 1),
                        ("--gpus-per-node", job.gpus_per_node + 1)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= {1 if flag == '--nodes' else 0}")
    limit = parse_time(job.time)
    if job.grace_s < 1 or job.grace_s >= limit:
        raise ConfigError(f"--grace {job.grace_s} s must be > 0 and shorter than --time {job.time} ({limit} s): the job "
                          "gets USR1 that long before its limit to checkpoint and requeue")
    check_name("--partition", job.partition)
    check_name("--account", job.account)
    check_name("--job-name", job.job_name)


def job_config(cfg: Config, job: SlurmJob) -> Config:
    """The run's config for this allocation: processes per node from the GPUs (or the layout), checked against it."""
    new = copy.deepcopy(cfg)
    new.launch.nnodes, new.launch.node_rank, new.launch.rdzv_endpoint = "1", 0, ""  # set by the job at run time
    new.launch.nproc_per_node = job.gpus_per_node  # 0: the layout's processes spread over the nodes
    if new.launch.launcher != "torchrun":
        raise ConfigError(f"launch.launcher = {new.launch.launcher!r}: a Slurm job runs plait's torchrun launcher on each "
                          "node; set launch.launcher='torchrun'")
    layout = Layout.from_config(new)
    layout.check_launch(job.nodes, f"--nodes {job.nodes}", job.gpus_per_node)
    return new


def check_run_path(run_dir: Path, flag: str = "--out") -> None:
    """The run dir goes into #SBATCH lines (--output) and a comment, which take no quoting: plain characters only."""
    path = str(run_dir.resolve())
    bad = sorted({c for c in path if not re.fullmatch(r"[A-Za-z0-9_./+,:@=%~-]", c)})
    if bad:
        raise ConfigError(f"{flag} {path!r}: a Slurm job script names the run dir in #SBATCH lines, which cannot quote "
                          f"{', '.join(repr(c) for c in bad)}; choose a path of letters, digits and _ . / + , : @ = ~ -")


def sbatch_script(job: SlurmJob, run_dir: Path, python: str = sys.executable) -> str:
    check_run_path(run_dir)
    run = shlex.quote(str(run_dir.resolve()))
    name = job.job_name or re.sub(r"[^A-Za-z0-9_.:+-]", "-", f"plait-{run_dir.resolve().name}")
    check_name("--job-name", name)
    opts = [f"--job-name={name}", f"--nodes={job.nodes}", "--ntasks-per-node=1"]
    if job.cpus_per_task:
        opts.append(f"--cpus-per-task={job.cpus_per_task}")
    if job.gpus_per_node:
        opts.append(f"--gpus-per-node={job.gpus_per_node}")
    opts.append(f"--time={job.time}")
    if job.partition:
        opts.append(f"--partition={job.partition}")
    if job.account:
        opts.append(f"--account={job.account}")
    opts += ["--requeue" if job.requeue else "--no-requeue", f"--signal=B:USR1@{job.grace_s}", "--open-mode=append",
             f"--output={run_dir.resolve()}/slurm-%j.out"]
    header = "\n".join(f"#SBATCH {o}" for o in opts)
    return f"""#!/bin/bash
# Written by `plait slurm` for {run_dir.resolve()}; submit with: sbatch {run}/job.sbatch
# One task per node: plait's launcher, meeting the others in a c10d rendezvous on the first node.
# USR1 ({job.grace_s} s before the time limit, or scancel --batch --signal=USR1) or SIGTERM: checkpoint, then
# {"requeue" if job.requeue else "end (plait cluster run resubmits the job when its policy says so)"}.
{header}

set -u
RUN_DIR={run}
PLAIT=({shlex.quote(python)} -m plait)

head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
addr=$(scontrol show node "$head" 2>/dev/null | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p' | head -n 1)
export MASTER_ADDR=${{MASTER_ADDR:-${{addr:-$head}}}}
export MASTER_PORT=${{MASTER_PORT:-$((15000 + SLURM_JOB_ID % 10000))}}
echo "plait: job $SLURM_JOB_ID (restart ${{SLURM_RESTART_COUNT:-0}}) on $SLURM_JOB_NODELIST, rendezvous $MASTER_ADDR:$MASTER_PORT"

REQUEUE={1 if job.requeue else 0}
requeue=0
stop() {{
    next=ending; [ "$REQUEUE" = 1 ] && next=requeueing
    echo "plait: $1: stopping at the next logging step, checkpointing, then $next job $SLURM_JOB_ID"
    requeue=1
    scancel --signal=TERM "$SLURM_JOB_ID"  # the job's steps (plait's launchers), not this shell; srun itself would kill them
}}
trap 'stop USR1' USR1
trap 'stop SIGTERM' TERM

srun --ntasks-per-node=1 --kill-on-bad-exit=1 "${{PLAIT[@]}}" train --resume "$RUN_DIR" \\
    --set "launch.nnodes=$SLURM_JOB_NUM_NODES" --set "launch.rdzv_endpoint=$MASTER_ADDR:$MASTER_PORT" &
step=$!
while :; do
    wait "$step"
    rc=$?
    kill -0 "$step" 2>/dev/null || break  # a signal ended the wait, not the step
done
if [ "$requeue" = 1 ]; then
    if [ "$REQUEUE" = 1 ]; then
        echo "plait: job step ended with $rc; requeueing"
        scontrol requeue "$SLURM_JOB_ID"
    else
        echo "plait: job step ended with $rc; preempted"
    fi
    exit 0
fi
exit "$rc"
"""


def write_job(cfg: Config, job: SlurmJob, run_dir: Path) -> Path:
    """RUN_DIR/config.toml and RUN_DIR/job.sbatch; returns the script's path."""
    check_job(job)
    cfg = job_config(cfg, job)
    if (run_dir / "checkpoints").exists():
        raise ConfigError(f"--out {run_dir} already holds a run with checkpoints; its job.sbatch continues it "
                          f"(sbatch {run_dir}/job.sbatch), or choose another --out")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(dump_config(cfg))
    path = run_dir / "job.sbatch"
    path.write_text(sbatch_script(job, run_dir))
    path.chmod(0o755)
    return path


def submit(script: Path) -> str:
    """sbatch the script; returns the job id."""
    if shutil.which("sbatch") is None:
        raise PlaitError(f"sbatch is not on PATH here; submit on the cluster's login node: sbatch {script}")
    r = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if r.returncode != 0:
        raise PlaitError(f"sbatch {script} failed: {(r.stderr or r.stdout).strip()}")
    return r.stdout.strip().split(";")[0]
