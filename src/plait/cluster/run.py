"""`plait cluster run`: a queue of real plait jobs shared over S process slots of this machine, under a policy.

Each job is a `plait train` run. The policy (plait.cluster.policies, the same functions the simulator uses) decides
who holds slots; preempting a job is plait's SIGTERM path (every rank stops at the next logging step, writes one
checkpoint and exits 0), and running it again is `plait train --resume RUN_DIR`, possibly with another number of
processes (migration and resizing): the data-parallel degree follows the processes (Layout.resolve: cp, tp and pp
stay) and the global batch stays, so the trajectory is the one the job has alone. A job is preempted only once it
has trained a step since it was (re)started: before that it has nothing to checkpoint, and stopping it would throw
its start-up away.

JOBS.toml:

    [[job]]
    name = "small"          # a folder name: DIR/jobs/small is its run directory
    config = "job.toml"     # optional; none: the built-in default job
    set = ["train.steps=40"]
    arrival = 0             # seconds after the cluster starts
    min_procs = 1           # the gang the policy schedules (default: one data-parallel replica, cp x tp x pp)
    max_procs = 2           # slots left over after a decision grow a starting job up to this, by whole replicas
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from plait.cluster.policies import JobView, Params, decide
from plait.config import dump_config, load_config
from plait.errors import ConfigError
from plait.launch.resume import absolute_paths
from plait.launch.slurm import SlurmJob, check_name, check_run_path, job_config, parse_time, sbatch_script
from plait.parallel.layout import Layout, dedicated_servers, replica_procs, resized
from plait.report.plots import plt, save
from plait.rundir import check_writable_run_dir

JOB_KEYS = {"name", "config", "set", "arrival", "min_procs", "max_procs"}


@dataclass
class JobSpec:
    name: str
    config: str | None
    sets: list[str]
    arrival: float
    min_procs: int
    max_procs: int
    steps: int
    model_parallel: int  # cp x tp x pp: processes per data-parallel replica (the job grows and shrinks by it)


@dataclass
class _Job:
    spec: JobSpec
    run_dir: Path
    proc: subprocess.Popen | SlurmJobHandle | None = None
    procs: int = 0
    slots: list[int] = field(default_factory=list)
    started: float = math.nan
    finished: float = math.nan
    failed: str = ""
    attained: float = 0.0
    executed: float = 0.0
    slice_start: float = 0.0
    last_run: float = -1.0
    waiting_since: float = 0.0
    segments: list[tuple[float, float, tuple[int, ...]]] = field(default_factory=list)
    preemptions: int = 0
    launches: int = 0
    steps_at_launch: int = 0
    log: object = None

    @property
    def done(self) -> bool:
        return not math.isnan(self.finished) or bool(self.failed)

    def steps_done(self) -> int:
        metrics = self.run_dir / "metrics.jsonl"
        if not metrics.is_file():
            return 0
        last = 0
        for line in metrics.read_text().splitlines():
            if '"loss"' in line:
                try:
                    last = max(last, int(json.loads(line)["step"]))
                except (ValueError, KeyError):
                    pass
        return last


def read_jobs(path: Path, slots: int) -> list[JobSpec]:
    """The queue from JOBS.toml; every job's config is loaded and checked before anything starts."""

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"jobs file {path} does not exist")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from None
    entries = data.get("job")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{path} has no [[job]] tables; give one per job (name, config, set, arrival, "
                          f"min_procs, max_procs)")
    specs, names = [], set()
    for i, e in enumerate(entries, start=1):
        where = f"{path}, job {i}"
        unknown = set(e) - JOB_KEYS
        if unknown:
            raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r}; a job has {', '.join(sorted(JOB_KEYS))}")
        name = str(e.get("name", f"job{i}"))
        if not name.replace("-", "").replace("_", "").isalnum() or name in names:
            raise ConfigError(f"{where}: name {name!r} must be unique and a plain folder name (letters, digits, - _)")
        names.add(name)
        config = e.get("config")
        if config is not None:
            config = str((path.parent / config).resolve()) if not Path(config).is_absolute() else config
        sets = [str(s) for s in e.get("set", [])]
        cfg = load_config(config, sets)
        mp, servers = replica_procs(cfg), dedicated_servers(cfg)
        lo, hi = int(e.get("min_procs", mp + servers)), int(e.get("max_procs", e.get("min_procs", mp + servers)))
        if not (1 <= lo <= hi <= slots) or (hi - lo) % mp:
            raise ConfigError(f"{where} ({name}): min_procs={lo}, max_procs={hi} must satisfy 1 <= min <= max <= "
                              f"--slots {slots}, max - min a multiple of cp x tp x pp = {mp} (the job grows by "
                              "whole data-parallel replicas)")
        for n in range(lo, hi + 1, mp):  # every size the job may run at, as Layout.resolve will fit it
            try:
                Layout.from_config(resized(cfg, n, f"{n} slots"))
            except ConfigError as e:
                raise ConfigError(f"{where} ({name}) on {n} processes: {e}; or change min_procs/max_procs") from None
        specs.append(JobSpec(name, config, sets, float(e.get("arrival", 0.0)), lo, hi, cfg.train.steps, mp))
    return specs


class LocalCluster:
    """Runs the queue as real processes on `slots` slots; `poll` seconds between looks at the queue."""

    def __init__(self, specs: list[JobSpec], slots: int, policy: str, out: Path, params: Params = Params(),
                 poll: float = 0.5, env: dict | None = None):
        self.slots, self.policy, self.params, self.poll = slots, policy, params, poll
        self.out = Path(out)
        self.jobs = {s.name: _Job(s, self.out / "jobs" / s.name) for s in specs}
        self.env = env if env is not None else dict(os.environ)
        self.events: list[dict] = []
        self.t0 = time.monotonic()
        self.t0_wall = time.time()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _view(self, j: _Job) -> JobView:
        left = max(0, j.spec.steps - j.steps_done())
        return JobView(j.spec.name, j.spec.arrival, j.procs if j.proc else j.spec.min_procs, float(left),
                       j.attained, j.executed, j.proc is not None, j.slice_start, j.last_run, j.waiting_since)

    def _command(self, j: _Job, procs: int) -> list[str]:
        # dp = "auto": Layout.resolve fits every degree to the processes when the run loads its config
        grow = ["--set", "parallel.dp='auto'", "--set", f"launch.nproc_per_node={procs}"]
        if not (j.run_dir / "checkpoints" / "latest").exists():  # never started, or stopped before a checkpoint
            shutil.rmtree(j.run_dir, ignore_errors=True)  # nothing was saved: start it afresh
            return [sys.executable, "-m", "plait", "train", *([j.spec.config] if j.spec.config else []),
                    *[a for s in j.spec.sets for a in ("--set", s)], *grow, "--out", str(j.run_dir)]
        return [sys.executable, "-m", "plait", "train", "--resume", str(j.run_dir), *grow]

    def _start(self, j: _Job, procs: int, free: list[int], now: float) -> None:
        j.slots, free[:] = free[:procs], free[procs:]
        j.procs = procs
        j.run_dir.parent.mkdir(parents=True, exist_ok=True)
        j.log = open(self.out / "jobs" / f"{j.spec.name}.log", "a")  # noqa: SIM115 (closed when the job stops)
        j.proc = subprocess.Popen(self._command(j, procs), env=self.env, stdout=j.log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        self._launched(j, procs, now)

    def _launched(self, j: _Job, procs: int, now: float, **event) -> None:
        """The books of a (re)start: launches, the steps it starts from, its first start, the event."""
        j.launches += 1
        j.steps_at_launch = j.steps_done()
        if math.isnan(j.started):
            j.started = now
        j.slice_start = now
        self.events.append({"t": round(now, 3), "job": j.spec.name, "event": "start", "procs": procs,
                            "slots": j.slots, "launch": j.launches, **event})

    def _stopped(self, j: _Job, now: float) -> None:
        j.segments.append((j.slice_start, now, tuple(j.slots)))
        j.proc, j.slots, j.procs = None, [], 0
        j.waiting_since = now
        if j.log:
            j.log.close()

    def _account(self, dt: float, now: float) -> None:
        for j in self.jobs.values():
            if j.proc is not None:
                j.attained += j.procs * dt
                j.executed += dt
                j.last_run = now

    def check_run_dirs(self) -> None:
        """A job's folder under OUT/jobs is plait's: one that holds other files (no config.toml) is refused before
        anything starts, so that starting the job afresh (which clears an unsaved attempt) loses no file of yours."""
        for j in self.jobs.values():
            check_writable_run_dir(j.run_dir, flag=f"--out {self.out}: the folder of job {j.spec.name!r},")

    def run(self, timeout: float = 3600.0) -> list[dict]:
        self.check_run_dirs()
        last = 0.0
        while not all(j.done for j in self.jobs.values()):
            now = self.now()
            if now > timeout:
                self.stop_all()
                raise ConfigError(f"plait cluster run: not done after {timeout:.0f} s; the runs so far are in "
                                  f"{self.out / 'jobs'}")
            self._account(now - last, now)
            last = now
            for j in self.jobs.values():  # completions and failures
                if j.proc is not None and j.proc.poll() is not None:
                    rc = j.proc.returncode
                    self._stopped(j, now)
                    summary = j.run_dir / "summary.json"
                    if rc == 0 and summary.is_file() and not json.loads(summary.read_text()).get("preempted"):
                        j.finished = min(now, summary.stat().st_mtime - self.t0_wall)  # when it wrote its summary
                        self.events.append({"t": round(j.finished, 3), "job": j.spec.name, "event": "finish"})
                    else:
                        j.failed = f"exit code {rc}; see {self.out / 'jobs' / (j.spec.name + '.log')}"
                        self.events.append({"t": round(now, 3), "job": j.spec.name, "event": "failed", "rc": rc})
            active = [j for j in self.jobs.values() if not j.done and j.spec.arrival <= now]
            if active:
                self._decide(active, now)
            time.sleep(self.poll)
        return self.table()

    def _decide(self, active: list[_Job], now: float) -> None:
        d = decide(self.policy, now, [self._view(j) for j in active], self.slots, self.params)
        if any(self.jobs[n].steps_done() <= self.jobs[n].steps_at_launch for n in d.preempt):
            return  # a job still starting up has nothing to checkpoint yet: preempt it once it trains
        for name in d.preempt:
            j = self.jobs[name]
            j.proc.send_signal(signal.SIGTERM)  # plait's preemption: checkpoint at the next logging step, exit 0
            try:
                j.proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                self._kill(j)
            j.preemptions += 1
            self.events.append({"t": round(self.now(), 3), "job": name, "event": "preempt"})
            self._stopped(j, self.now())
            if (j.run_dir / "summary.json").is_file() and not json.loads(
                    (j.run_dir / "summary.json").read_text()).get("preempted"):
                j.finished = self.now()  # it finished before the signal reached it
        taken = {s for j in self.jobs.values() for s in j.slots}
        free = [s for s in range(self.slots) if s not in taken]
        starting = [self.jobs[n] for n in d.start]
        extra = len(free) - sum(j.spec.min_procs for j in starting)
        for j in starting:  # slots the gangs leave free grow the starting jobs, in the policy's order
            grow = min(extra, j.spec.max_procs - j.spec.min_procs) // j.spec.model_parallel * j.spec.model_parallel
            extra -= grow
            self._start(j, j.spec.min_procs + grow, free, self.now())
        for name in d.keep:
            j = self.jobs[name]
            if now - j.slice_start >= self.params.quantum:
                j.segments.append((j.slice_start, now, tuple(j.slots)))
                j.slice_start = now

    def _kill(self, j: _Job) -> None:
        os.killpg(j.proc.pid, signal.SIGKILL)
        j.proc.wait()

    def stop_all(self) -> None:
        for j in self.jobs.values():
            if j.proc is not None and j.proc.poll() is None:
                os.killpg(j.proc.pid, signal.SIGTERM)
                j.proc.wait(timeout=120)

    def table(self) -> list[dict]:
        rows = []
        for j in self.jobs.values():
            rows.append({"job": j.spec.name, "arrival_s": j.spec.arrival, "steps": j.spec.steps,
                         "completion_s": j.finished - j.spec.arrival if not math.isnan(j.finished) else None,
                         "queueing_s": j.started - j.spec.arrival if not math.isnan(j.started) else None,
                         "preemptions": j.preemptions, "launches": j.launches,
                         "procs": sorted({len(s) for _, _, s in j.segments}), "failed": j.failed or None,
                         "run_dir": str(j.run_dir)})
        return rows

    def summary(self) -> dict:
        ends = [j.finished for j in self.jobs.values() if not math.isnan(j.finished)]
        start = min(j.spec.arrival for j in self.jobs.values())
        last = max((b for j in self.jobs.values() for _, b, _ in j.segments), default=None)
        makespan = (last - start) if last is not None else None
        held = sum((b - a) * len(s) for j in self.jobs.values() for a, b, s in j.segments)
        return {"policy": self.policy, "slots": self.slots, "makespan_s": makespan,
                "slot_utilisation": held / (self.slots * makespan) if makespan else None,
                "avg_completion_s": (sum(r["completion_s"] for r in self.table() if r["completion_s"] is not None)
                                     / max(1, len(ends))),
                "jobs": self.table(), "events": self.events}


def gantt(cluster: LocalCluster, out: Path) -> Path:
    """Which job held which slot when."""
    fig, ax = plt.subplots(figsize=(8, 0.6 * cluster.slots + 1.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, j in enumerate(cluster.jobs.values()):
        for a, b, slots in j.segments:
            for s in slots:
                ax.broken_barh([(a, b - a)], (s - 0.4, 0.8), color=colors[k % len(colors)],
                               label=j.spec.name if (a, s) == (j.segments[0][0], slots[0]) else None)
                ax.text(a + (b - a) / 2, s, j.spec.name, ha="center", va="center", fontsize=8, color="white")
    ax.set_yticks(range(cluster.slots), [f"slot {s}" for s in range(cluster.slots)])
    ax.set_xlabel("seconds since the cluster started")
    ax.set_title(f"plait cluster run --policy {cluster.policy}")
    ax.grid(axis="x", alpha=0.3)
    return save(fig, out)



# ----------------------------------------------------------------------------- Slurm


class SlurmJobHandle:
    """A submitted Slurm job, seen through squeue/scontrol as LocalCluster sees a process (poll, wait, signal)."""

    def __init__(self, job_id: str, env: dict):
        self.job_id, self.env = job_id, env
        self.returncode: int | None = None

    def _run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), capture_output=True, text=True, env=self.env, timeout=60)

    def poll(self) -> int | None:
        if self.returncode is None:
            r = self._run("squeue", "-h", "-j", self.job_id, "-o", "%T")
            if r.returncode == 0 and r.stdout.strip():
                return None  # pending, running, completing
            if r.returncode != 0 and "Invalid job id" not in r.stderr:
                return None  # a busy slurmctld answers late: that is not a finished job
            show = self._run("scontrol", "show", "job", self.job_id).stdout
            state = next((w.split("=", 1)[1] for w in show.split() if w.startswith("JobState=")), "")
            code = next((w.split("=", 1)[1] for w in show.split() if w.startswith("ExitCode=")), "0:0")
            if state in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED"):
                return None
            exit_code, sig = (int(x) for x in code.split(":")) if ":" in code else (0, 0)
            self.returncode = exit_code or (128 + sig if sig else 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"slurm job {self.job_id}", timeout)
            time.sleep(0.3)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Preemption: USR1 to the batch script, which stops the job step at its next logging step (a checkpoint)
        and ends the job without requeueing it."""
        self._run("scancel", "--batch", "--signal=USR1", self.job_id)

    def kill(self) -> None:
        self._run("scancel", self.job_id)


class SlurmQueue(LocalCluster):
    """The same queue and policies on a Slurm cluster: a job started on N slots is an N-node `plait slurm` job
    (one process per node), preempted by USR1 (checkpoint, end; no requeue) and resubmitted, possibly on another
    number of nodes, when the policy runs it again. Slurm places the jobs; the policy only decides how many nodes
    each holds, so slots are node counts here. `time` is each submission's --time."""

    def __init__(self, *args, time_limit: str = "01:00:00", partition: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        parse_time(time_limit)  # --time and --partition go into #SBATCH lines: checked before anything is submitted
        check_name("--partition", partition)
        for j in self.jobs.values():
            check_name("job name", f"plait-{j.spec.name}")
            check_run_path(j.run_dir, f"--out {self.out}: the folder of job {j.spec.name!r},")
        self.time_limit, self.partition = time_limit, partition

    def _start(self, j: _Job, procs: int, free: list[int], now: float) -> None:
        j.slots, free[:] = free[:procs], free[procs:]
        j.procs = procs
        j.run_dir.mkdir(parents=True, exist_ok=True)
        saved = j.run_dir / "config.toml"
        if saved.is_file() and (j.run_dir / "checkpoints" / "latest").exists():
            cfg = load_config(saved)
        else:  # never started, or stopped before its first checkpoint: from the job's own config
            cfg = load_config(j.spec.config, j.spec.sets)
            absolute_paths(cfg)
        cfg = resized(cfg, procs, f"{procs} nodes")
        job = SlurmJob(nodes=procs, time=self.time_limit, partition=self.partition, requeue=False,
                       job_name=f"plait-{j.spec.name}")
        saved.write_text(dump_config(job_config(cfg, job)))
        script = j.run_dir / "job.sbatch"
        script.write_text(sbatch_script(job, j.run_dir))
        r = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, env=self.env)
        if r.returncode != 0:
            raise ConfigError(f"plait cluster run --backend slurm: sbatch {script} failed: {(r.stderr or r.stdout).strip()}")
        job_id = r.stdout.strip().split(";")[0]
        j.proc = SlurmJobHandle(job_id, self.env)
        j.log = None
        with open(self.out / "jobs" / f"{j.spec.name}.log", "a") as f:
            f.write(f"slurm job {job_id} on {procs} node(s): {j.run_dir / f'slurm-{job_id}.out'}\n")
        self._launched(j, procs, now, slurm_job_id=job_id)

    def _kill(self, j: _Job) -> None:
        j.proc.kill()
        j.proc.wait(timeout=120)

    def stop_all(self) -> None:
        for j in self.jobs.values():
            if j.proc is not None and j.proc.poll() is None:
                j.proc.send_signal(signal.SIGUSR1)  # checkpoint and end; `plait cluster run` again resubmits
