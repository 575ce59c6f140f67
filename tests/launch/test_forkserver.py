"""The workers' fork server (plait.launch.forkserver): started before the launcher imports torch, gone after."""

from __future__ import annotations

import subprocess
import sys


def test_the_launcher_reads_a_job_without_importing_torch():
    # warm() must run while torch is still to be imported: start.py and what it imports at the top import no torch
    code = ("import sys; import plait.launch.start, plait.launch.forkserver; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout.strip()) == (0, "[]"), r.stderr


def test_warm_starts_one_fork_server_with_the_workers_env_and_stop_ends_it():
    code = """
import os, multiprocessing.forkserver as fs
from plait.config import load_config
from plait.launch import forkserver
os.environ.pop("OMP_NUM_THREADS", None)
cfg = load_config(None, ["parallel.dp=2"])
forkserver.warm(cfg)
pid = fs._forkserver._forkserver_pid
forkserver.warm(cfg)  # a second warm: the same server
assert fs._forkserver._forkserver_pid == pid
print(os.environ["OMP_NUM_THREADS"] == str(max(1, os.cpu_count() // 2)), os.path.exists(f"/proc/{pid}"))
forkserver.stop()
print(fs._forkserver._forkserver_pid, os.path.exists(f"/proc/{pid}"))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["True True", "None False"], r.stdout + r.stderr
