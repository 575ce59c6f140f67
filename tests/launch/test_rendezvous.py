"""A one-machine job needs no network: its rendezvous store (which torch's agent unpickles) and the workers' store
listen on loopback only, under a run id nobody can guess (issue 37 N3); a multi-node node 0 says its port is open."""

import socket
import subprocess
import sys
import time

import psutil
import pytest

from helpers import ENV, process_tree
from plait.config import load_config
from plait.launch import rendezvous
from plait.launch.torchrun import launch_config


def _listening(pids: list[int]) -> set[tuple[str, int]]:
    addrs = set()
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        addrs |= {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}
    return addrs


def test_a_one_machine_job_listens_on_loopback_only(sgd_job, tmp_path):
    go, run = tmp_path / "go", tmp_path / "run"
    env = {**ENV, "PLAIT_FAULTS": f"stall:step=2:until={go}:seconds=120"}
    p = subprocess.Popen([sys.executable, "-m", "plait", "train", str(sgd_job), "--out", str(run)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, seen = time.time() + 120, set()
        while time.time() < deadline and p.poll() is None and not (run / "metrics.jsonl").is_file():  # step 1: stores up
            time.sleep(0.1)
        seen = _listening(process_tree(p.pid))
        assert seen and p.poll() is None, "the job had no listening socket"
        assert {ip for ip, _ in seen} == {"127.0.0.1"}, seen
        outside = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                   if a.family == socket.AF_INET and not a.address.startswith("127.")]
        for ip in outside:  # what an attacker on the network would try: every port of the job, refused
            for _, port in seen:
                with pytest.raises(OSError):
                    socket.create_connection((ip, port), timeout=2).close()
    finally:
        go.touch()
        out = p.communicate(timeout=120)[0]
    assert p.returncode == 0, out


def test_the_run_id_is_random_and_multi_node_is_unchanged(sgd_job, tmp_path):
    cfg = load_config(sgd_job)
    a, b = launch_config(cfg, tmp_path), launch_config(cfg, tmp_path)
    assert a.rdzv_backend == rendezvous.BACKEND and a.local_addr == "127.0.0.1"
    assert a.run_id.startswith(f"plait-{tmp_path.name}-") and len(a.run_id) == len(f"plait-{tmp_path.name}-") + 32
    assert a.run_id != b.run_id
    multi = load_config(sgd_job, ["launch.nnodes='2'", "launch.rdzv_endpoint='10.0.0.1:29500'"])
    m = launch_config(multi, tmp_path)
    assert (m.rdzv_backend, m.rdzv_endpoint, m.run_id) == ("c10d", "10.0.0.1:29500", f"plait-{tmp_path.name}")
    assert rendezvous.exposure_line("10.0.0.1:29500") == (
        "plait: this node hosts the job's rendezvous at 10.0.0.1:29500 on every interface: let only the job's nodes "
        "reach that port (torch's agent unpickles what it reads there; see docs/security.md)")
