"""Two machines on one: a 2-node elastic job across network namespaces survives losing a node's link.

Needs root and iproute2 (`ip netns`); skipped, saying why, elsewhere. Node 0 runs in one namespace
and hosts the rendezvous (is_host, since its hostname resolves to neither address), node 1 in the
other, joined by a veth pair. Mid-run node 1's link goes down; node 0 times out on it, re-forms
the job alone (nnodes = 1:2) and finishes on the same trajectory as an uninterrupted run.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from helpers import max_diff, process_tree, weights

pytestmark = pytest.mark.netns


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2's `ip netns` (apt-get install iproute2)")
    tag = uuid.uuid4().hex[:6]
    a, b = f"plait-a-{tag}", f"plait-b-{tag}"
    try:
        _ip("netns", "add", a)
        _ip("netns", "add", b)
    except subprocess.CalledProcessError as e:
        _ip("netns", "del", a, check=False)
        pytest.skip(f"cannot create network namespaces here: {e.stderr.strip()}")
    try:
        _ip("link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
        _ip("link", "set", f"va{tag}", "netns", a)
        _ip("link", "set", f"vb{tag}", "netns", b)
        for ns, dev, addr in ((a, f"va{tag}", "10.231.7.1/24"), (b, f"vb{tag}", "10.231.7.2/24")):
            _ip("-n", ns, "addr", "add", addr, "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield {"a": a, "b": b, "dev_a": f"va{tag}", "dev_b": f"vb{tag}", "addr_a": "10.231.7.1"}
    finally:
        _ip("netns", "del", a, check=False)
        _ip("netns", "del", b, check=False)


@pytest.mark.slow
def test_a_node_whose_link_goes_down_is_dropped_and_the_job_finishes(two_hosts, job, uninterrupted, tmp_path):
    h = two_hosts
    run = tmp_path / "run"
    common = ["-m", "plait", "train", str(job), "--out", str(run), "--set", "launch.nnodes='1:2'",
              "--set", f"launch.rdzv_endpoint={h['addr_a']}:29533", "--set", "launch.max_restarts=1",
              "--set", "launch.timeout_s=10"]
    go = tmp_path / "link-is-down"
    # Events, not clocks: a node 0 that formed the job alone (node 1 still importing torch) waits at step 1 until
    # node 1's joining stops it, and at step 5 both nodes wait for the test to have taken node 1's link down, so the
    # 2-node job cannot finish before the link is gone, however loaded the machine (first incarnation only)
    base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "PLAIT_FAULTS": f"stall:step=1:world=1:until=stop:seconds=180;stall:step=5:until={go}:seconds=120"}
    base.pop("GLOO_SOCKET_IFNAME", None)
    procs = []
    try:
        node0 = subprocess.Popen(["ip", "netns", "exec", h["a"], sys.executable, *common, "--set", "launch.node_rank=0"],
                                 env={**base, "GLOO_SOCKET_IFNAME": h["dev_a"]}, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
        procs.append(node0)
        node1 = subprocess.Popen(["ip", "netns", "exec", h["b"], sys.executable, *common, "--set", "launch.node_rank=1"],
                                 env={**base, "GLOO_SOCKET_IFNAME": h["dev_b"]}, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
        procs.append(node1)
        deadline = time.time() + 120
        while time.time() < deadline and not (run / "checkpoints" / "step_0000003").is_dir():
            time.sleep(0.2)
        assert (run / "checkpoints" / "step_0000003").is_dir(), "the 2-node job never reached its first checkpoint"
        _ip("-n", h["b"], "link", "set", h["dev_b"], "down")  # node 1 drops off the network
        go.touch()
        out, _ = node0.communicate(timeout=240)
    finally:
        for p in procs:
            if p.poll() is None:
                for pid in process_tree(p.pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                p.wait(timeout=30)
    assert node0.returncode == 0, out
    assert "world size is 1 (the config asks for 2)" in out and "resuming from" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["steps"] == 10
    assert max_diff(uninterrupted, weights(run)) <= 1e-5

