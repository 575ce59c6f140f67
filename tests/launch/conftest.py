"""Fixtures of the launcher tests: a tiny SGD job and its torchrun weights, a two-node Slurm cluster on this host,
a local Ray cluster. Each cluster is started once per session and stopped by the PIDs it started."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch_helpers import free_port, port_free

from helpers import ENV, plait, weights

# An MLP on sklearn's digits with plain SGD: weights compared across launchers at 1e-5 (AdamW would hide a wrong
# gradient scale). 10 steps, a checkpoint every 3, a metrics line every step (the stop-flag agreement rides on it).
SGD_JOB = """
[model]
name = "mlp"
width = 32
depth = 1
[data]
name = "digits"
prefetch = 0
[train]
steps = 10
global_batch_size = 16
micro_batch_size = 8
eval_samples = 32
sample_tokens = 0
[optim]
name = "sgd"
lr = 0.05
momentum = 0.0
weight_decay = 0.0
warmup_steps = 0
schedule = "constant"
grad_clip = 0.0
[parallel]
dp = 2
[checkpoint]
every = 3
keep = 3
[log]
every = 1
progress = false
report = false
[launch]
timeout_s = 60
"""


@pytest.fixture(scope="session")
def sgd_job(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sgd") / "job.toml"
    path.write_text(SGD_JOB)
    return path


@pytest.fixture(scope="session")
def sgd_reference(sgd_job, tmp_path_factory) -> dict:
    """The job's weights under plait's torchrun launcher: every other launcher must end on them."""
    run = tmp_path_factory.mktemp("sgd-torchrun") / "run"
    r = plait("train", sgd_job, "--out", run)
    assert r.returncode == 0, r.stdout + r.stderr
    return weights(run)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.time() + 15
    for p in reversed(procs):
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# ---- Slurm: slurmctld + two slurmd (n1, n2) on this host, munge for authentication


class SlurmCluster:
    def __init__(self, root: Path, conf: Path):
        self.root, self.conf = root, conf
        self.env = {**ENV, "SLURM_CONF": str(conf)}

    def run(self, *args: str, check: bool = True, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        r = subprocess.run(list(args), capture_output=True, text=True, env=kw.pop("env", self.env), timeout=timeout, **kw)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed ({r.returncode}): {r.stdout}{r.stderr}")
        return r

    def state(self, job: str) -> str:
        """The job's state (RUNNING, PENDING, ...), "" once it has left the queue, "UNKNOWN" while squeue fails
        (a busy slurmctld answers late: that is not a finished job)."""
        try:
            r = self.run("squeue", "-h", "-j", job, "-o", "%T", check=False)
        except subprocess.TimeoutExpired:
            return "UNKNOWN"
        if r.returncode != 0:
            return "" if "Invalid job id" in r.stderr else "UNKNOWN"
        return r.stdout.strip()

    def wait_gone(self, job: str, timeout: float) -> None:
        deadline = time.time() + timeout
        while self.state(job) and time.time() < deadline:
            time.sleep(0.3)
        assert not self.state(job), f"job {job} still {self.state(job)} after {timeout} s"

    def exit_code(self, job: str) -> str:
        return self.run("scontrol", "show", "job", job, check=False).stdout


SLURM_DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel")


# module scope: only test_slurm.py uses the cluster, and daemons idling through the rest of the suite cost CPU
@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = [d for d in SLURM_DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]
    if os.geteuid() != 0 or missing:
        pytest.skip("needs root and Slurm with munge (apt-get install slurmctld slurmd slurm-client munge; .ci/run "
                    f"does it): {'not root' if os.geteuid() else 'missing ' + ', '.join(missing)}")
    root = tmp_path_factory.mktemp("slurm")
    for d in ("munge", "state", "spool", "log"):
        (root / d).mkdir()
    (root / "munge").chmod(0o700)
    key = root / "munge" / "key"
    subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True)
    host = socket.gethostname()
    ctld, d1, d2 = free_port(), free_port(), free_port()
    while d2 != d1 + 1:  # two slurmd on one host: a Port=[a-b] range
        d1 = free_port()
        d2 = d1 + 1 if port_free(d1 + 1) else free_port()
    # job ids (and so the rendezvous ports 15000 + id % 10000) start at a random place: sessions run side by side
    first = next(j for j in (random.randint(1000, 9900) for _ in range(50)) if all(port_free(15000 + j + k) for k in range(8)))
    conf = root / "slurm.conf"
    conf.write_text(f"""ClusterName=plaittest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/sock
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobRequeue=1
FirstJobId={first}
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
KillWait=30
MinJobAge=300
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SwitchType=switch/none
PlugStackConfig=/dev/null
NodeName=n[1-2] NodeHostname={host} NodeAddr=127.0.0.1 Port=[{d1}-{d2}] CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
""")
    env = {**ENV, "SLURM_CONF": str(conf)}
    procs = []
    try:
        procs.append(subprocess.Popen(["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={root}/munge/sock",
                                       f"--pid-file={root}/munge/pid", f"--log-file={root}/munge/log",
                                       f"--seed-file={root}/munge/seed"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.time() + 10
        while not (root / "munge" / "sock").exists() and time.time() < deadline:
            time.sleep(0.05)
        procs.append(subprocess.Popen(["slurmctld", "-D", "-i", "-f", str(conf)], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        for node in ("n1", "n2"):
            procs.append(subprocess.Popen(["slurmd", "-D", "-N", node, "-f", str(conf)], env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
        cluster = SlurmCluster(root, conf)
        deadline = time.time() + 30
        while time.time() < deadline:
            states = cluster.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout.split()
            if states.count("idle") == 2:
                break
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.3)
        else:
            states = []
        if states.count("idle") != 2:
            logs = "\n".join(f.read_text()[-1500:] for f in (root / "log").glob("*.log"))
            pytest.fail(f"the test Slurm cluster did not come up (sinfo: {states}):\n{logs}")
        yield cluster
    finally:
        _stop(procs)


# ---- Ray: one local cluster (`ray start --head --block`), stopped through its own process group

RAY_READY_S = 180.0  # a loaded 2-core runner has taken over 60 s to bring a head up


def wait_ray_ready(ray_bin: Path, address: str, env: dict, head: subprocess.Popen, log: Path,
                   budget_s: float = RAY_READY_S, pause_s: float = 0.5) -> float:
    """Poll `ray status` until the head at `address` answers; returns the seconds it took. Each call may take longer
    than the one before (a loaded machine answers late, and a call cut short tells nothing) and the pause between calls
    grows from pause_s, all within budget_s; on failure the message says what the calls and `ray start` printed."""
    t0 = time.monotonic()
    deadline, pause, call_s, calls, last = t0 + budget_s, pause_s, 10.0, 0, "no call made"
    while (left := deadline - time.monotonic()) > 0:
        calls += 1
        limit = min(call_s, max(1.0, left))
        try:
            r = subprocess.run([str(ray_bin), "status", f"--address={address}"], capture_output=True, text=True,
                               env=env, timeout=limit)
            if r.returncode == 0:
                return time.monotonic() - t0
            last = f"exit {r.returncode}: {(r.stdout + r.stderr).strip()[-1500:]}"
        except subprocess.TimeoutExpired:
            last = f"no answer in {limit:.0f} s"
        if head.poll() is not None:
            pytest.fail(f"ray start exited with {head.returncode} after {time.monotonic() - t0:.0f} s:\n"
                        f"{log.read_text()[-3000:]}")
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause, call_s = min(2 * pause, 5.0), min(2 * call_s, 60.0)
    pytest.fail(f"the local Ray cluster at {address} did not come up in {budget_s:.0f} s ({calls} `ray status` calls; "
                f"the last: {last})\nray start printed:\n{log.read_text()[-3000:]}")


# module scope: a Ray head (GCS, raylet, agents) idles at ~10 % of a core; kept for the whole session it cost the suite
# about 150 CPU seconds (counted with RUSAGE_CHILDREN at its teardown)
@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    pytest.importorskip("ray.train.torch", reason="needs Ray Train: pip install 'plait[ray]'")
    ray_bin = Path(sys.executable).parent / "ray"
    temp = Path("/tmp") / f"ray-plait-{os.getpid()}"  # Ray's socket paths must stay short
    log = tmp_path_factory.mktemp("ray") / "ray-start.log"  # a file, readable while the head runs (a pipe is not)
    port = free_port()
    # RAY_AUTH_MODE: a token left in ~/.ray by any earlier local ray.init() turns token auth on for `ray start`, and
    # `ray status` is then refused; this cluster is loopback-only and lives for the module
    # RAY_TRAIN_HEALTH_CHECK_INTERVAL_S: Ray Train's controller polls its workers every 2 s by default, and each run
    # waits on that poll to see its workers finish (and a restart, to see one die): 0.5 s keeps those waits short
    env = {**ENV, "RAY_USAGE_STATS_ENABLED": "0", "RAY_TRAIN_V2_ENABLED": "1", "RAY_AUTH_MODE": "disabled",
           "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}
    # the ports a head would take by default are this session's own (others may run a cluster too), and workers stay
    # off 15000-29999, where the Slurm and MPI tests' rendezvous ports are derived
    with log.open("w") as out:
        p = subprocess.Popen([str(ray_bin), "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
                              "--include-dashboard=false", f"--temp-dir={temp}", "--disable-usage-stats",
                              f"--dashboard-agent-listen-port={free_port()}",
                              "--min-worker-port=30000", "--max-worker-port=32000"],
                             env=env, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        wait_ray_ready(ray_bin, address, env, p, log)
        yield {**env, "RAY_ADDRESS": address}
    finally:
        # everything `ray start` started runs in the session (process group) it leads: stop that group, by its id
        # (a head drains for up to 30 s on SIGTERM before it stops: 1 s of grace, then SIGKILL, ends it as surely)
        for sig, grace in ((signal.SIGTERM, 1), (signal.SIGKILL, 10)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                continue
        p.wait()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture
def ray_ready_wait():
    """The readiness wait itself, for a test of what it reports (with a stand-in for `ray`)."""
    return wait_ray_ready
