"""The workers' fork server (plait.launch.forkserver): started while the launcher reads the job, gone after."""

from __future__ import annotations

import subprocess
import sys


def test_the_launcher_reads_a_job_without_importing_torch():
    # a dry run imports no torch, and warm() starts the fork server before the launcher checks the job: start.py and
    # what it imports at the top import no torch
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


SERVER = """
import os, signal, threading, time, multiprocessing.forkserver as fs
from plait.config import load_config
from plait.launch import forkserver
signal.signal(signal.SIGUSR1, lambda *a: None)  # a handler of the launcher's: not the server's
held = open(os.devnull)  # a file the launcher has open: not the server's
if {thread}:
    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
forkserver.warm(load_config(None, ["parallel.dp=2"]))
pid = fs._forkserver._forkserver_pid
for _ in range(100):  # the child closes the files and resets the handlers once forked: up to 10 s on a loaded machine
    time.sleep(0.1)
    caught = int(next(l for l in open(f"/proc/{{pid}}/status") if l.startswith("SigCgt:")).split()[1], 16)
    got = (open(f"/proc/{{pid}}/cmdline").read() == open("/proc/self/cmdline").read(),  # forked: this command line
           str(held.fileno()) in os.listdir(f"/proc/{{pid}}/fd"), bool(caught >> (signal.SIGUSR1 - 1) & 1))
    if not got[1] and not got[2]:
        break
print(*got)
forkserver.stop()
"""


def test_the_server_is_forked_from_the_launcher_without_its_files_and_handlers_or_spawned_beside_threads():
    """Forked once the launcher has imported torch (torch imported once, not again by a new interpreter), holding
    none of the launcher's files or signal handlers; where the launcher runs another thread, spawned as
    multiprocessing does (a fork would copy that thread's locks, not the thread)."""
    forked = subprocess.run([sys.executable, "-c", SERVER.format(thread=False)], capture_output=True, text=True,
                            timeout=60)
    assert forked.returncode == 0, forked.stderr
    assert forked.stdout.split("\n")[0] == "True False False", forked.stdout
    spawned = subprocess.run([sys.executable, "-c", SERVER.format(thread=True)], capture_output=True, text=True,
                             timeout=60)
    assert spawned.returncode == 0, spawned.stderr
    assert spawned.stdout.split("\n")[0] == "False False False", spawned.stdout
