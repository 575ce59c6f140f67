"""Fault tolerance, torchft style: inject a failure at a chosen (rank, step), then compare with an uninterrupted run."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from helpers import ENV, max_diff, plait, process_tree, weights
from plait.errors import CheckpointError
from plait.train.checkpoint import find_resumable, verify


@pytest.mark.slow
def test_killed_worker_restarts_from_the_last_checkpoint(job, uninterrupted, tmp_path):
    run = tmp_path / "run"
    r = plait("train", job, "--out", run, "--set", "launch.max_restarts=1", faults="kill:rank=1:step=8")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resuming from" in r.stdout and "step_0000006" in r.stdout  # steps 7 and 8 are lost, no more
    # one line per restart, naming the rank that died (not the one that lost its peer) and how
    assert "plait: worker rank 1 was killed by SIGKILL; restart 1 of 1 from step_0000006\n" in r.stderr, r.stderr
    assert "failed (exitcode" not in r.stderr and "Traceback" not in r.stderr
    assert max_diff(uninterrupted, weights(run)) <= 1e-6


def test_a_killed_worker_is_named_with_the_resume_command(job, tmp_path):
    run = tmp_path / "run"
    r = plait("train", job, "--out", run, faults="kill:rank=1:step=5")
    assert r.returncode == 1
    latest = sorted(p.name for p in (run / "checkpoints").glob("step_*"))[-1]
    assert r.stderr.strip().splitlines()[-1] == (
        "error: worker rank 1 was killed by SIGKILL (from outside plait: the out-of-memory killer, a user or the "
        f"scheduler); the other ranks stopped with it; the latest checkpoint is {latest}: continue with plait train "
        f"--resume {run}")
    assert len(r.stderr.strip().splitlines()) <= 3, r.stderr


@pytest.mark.slow
def test_kill_while_publishing_a_checkpoint_never_corrupts_latest(job, uninterrupted, tmp_path):
    run = tmp_path / "run"
    r = plait("train", job, "--out", run, "--set", "launch.max_restarts=1", faults="kill:rank=0:step=6:at=publish")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "step_0000003 at step 3" in r.stdout  # step 6 was never published; 3 was the latest good one
    assert max_diff(uninterrupted, weights(run)) <= 1e-6
    for ckpt in (run / "checkpoints").glob("step_*"):
        verify(ckpt)


def _train_until_two_steps(job, run: Path) -> subprocess.Popen:
    p = _start_slow(job, run)
    _wait_two_steps(p, run)
    return p


def _start_slow(job, run: Path) -> subprocess.Popen:
    env = {**ENV, "PLAIT_FAULTS": "slow:seconds=0.4"}  # every rank, every step: time to send the signal
    return subprocess.Popen([sys.executable, "-m", "plait", "train", str(job), "--out", str(run)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_two_steps(p: subprocess.Popen, run: Path) -> None:
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        if metrics.is_file() and sum(1 for line in metrics.read_text().splitlines() if '"loss"' in line) >= 2:
            break
        time.sleep(0.2)


SIGNALS = {signal.SIGTERM: "preempted (SIGTERM)", signal.SIGINT: "interrupted (Ctrl-C)"}


@pytest.fixture(scope="module")
def signalled(job, tmp_path_factory) -> dict:
    """One run per signal, side by side (each mostly sleeps through its slowed steps): each gets its signal after two
    steps, then both resume, side by side too. {signal: (run dir, the stopped run (returncode, stdout, stderr,
    summary.json's bytes, where checkpoints/latest pointed), the resume's CompletedProcess)}."""
    runs = {sig: tmp_path_factory.mktemp(sig.name) / "run" for sig in SIGNALS}
    procs = {sig: _start_slow(job, run) for sig, run in runs.items()}
    try:
        for sig, p in procs.items():
            _wait_two_steps(p, runs[sig])
            p.send_signal(sig)
        outs = {sig: p.communicate(timeout=120) for sig, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    # what the stop left, read before the resume rewrites it
    stopped = {sig: (procs[sig].returncode, *outs[sig], _read(run / "summary.json"), _link(run / "checkpoints" / "latest"))
               for sig, run in runs.items()}
    with ThreadPoolExecutor(len(runs)) as pool:
        resumed = dict(zip(runs, pool.map(lambda run: plait("train", "--resume", run), runs.values())))
    return {sig: (runs[sig], stopped[sig], resumed[sig]) for sig in SIGNALS}


def _link(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


@pytest.mark.parametrize("sig", list(SIGNALS), ids=[sig.name for sig in SIGNALS])
def test_sigterm_checkpoints_and_resume_continues(signalled, uninterrupted, sig):
    """SIGTERM (a scheduler) and Ctrl-C do the same: every rank stops at the next logging step, one checkpoint, exit 0,
    the resume command printed, no traceback."""
    said = SIGNALS[sig]
    run, (returncode, out, err, summary_json, latest), r = signalled[sig]
    assert returncode == 0, out + err
    assert f"{said}: stopped cleanly at step_" in out, out + err
    assert (out + err).count("continue with plait train --resume") == 1, out + err  # said once, by rank 0
    assert "death signal" not in err and "via signal" not in err, err  # the agent's echo of the same stop
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err, out + err
    summary = json.loads(summary_json)
    assert summary["preempted"] and 2 <= summary["steps"] < 10
    assert latest == f"step_{summary['steps']:07d}"
    assert r.returncode == 0, r.stdout + r.stderr
    assert max_diff(uninterrupted, weights(run)) <= 1e-6


def test_a_second_ctrl_c_stops_at_once(job, tmp_path):
    run = tmp_path / "run"
    p = _train_until_two_steps(job, run)
    p.send_signal(signal.SIGINT)
    time.sleep(0.3)
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert time.monotonic() - t0 < 10
    assert p.returncode == 128 + signal.SIGINT, out + err
    assert "Ctrl-C again to stop at once" in err and "interrupted again: workers killed" in err, err
    time.sleep(0.5)
    left = [c for c in Path("/proc").glob("[0-9]*/cmdline") if str(run).encode() in _read(c)]
    assert not left, "workers outlived a second Ctrl-C"


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_damaged_checkpoints_are_named_and_skipped(pool2, tiny_text, tmp_path):
    from helpers import rank0_params, tiny_gpt_config

    pool2.run(rank0_params, tiny_gpt_config(tiny_text, "train.steps=9", "checkpoint.every=3", "checkpoint.keep=3"),
              tmp_path)
    root = tmp_path / "checkpoints"
    s3, s6, s9 = (root / f"step_{n:07d}" for n in (3, 6, 9))
    shard = sorted(s9.glob("*.distcp"))[0]
    _corrupt(shard)
    with pytest.raises(CheckpointError, match=f"{shard.name} does not match its checksum"):
        verify(s9)
    shard6 = sorted(s6.glob("*.distcp"))[0]
    shard6.write_bytes(shard6.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=rf"{shard6.name} has \d+ bytes, the manifest says \d+ \(truncated\?\)"):
        verify(s6)
    said = []
    assert find_resumable(tmp_path, log=said.append) == s3
    assert len(said) == 2 and "step_0000009" in said[0] and "step_0000006" in said[1]
    (s3 / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=".metadata is missing"):
        verify(s3)
    with pytest.raises(CheckpointError, match="no checkpoint under .* verifies"):
        find_resumable(tmp_path, log=said.append)


@pytest.mark.slow
def test_resume_falls_back_past_a_corrupt_checkpoint(straight_run, uninterrupted, tmp_path):
    # A run stopped after step 9 (checkpoints at 6 and 9): the straight run's copy without its last checkpoint, instead
    # of a 2-process run of its own (the same steps; a copy, so the session's run is left as it was)
    run = tmp_path / "run"
    shutil.copytree(straight_run, run, symlinks=True,
                    ignore=shutil.ignore_patterns("step_0000010", "summary.json", "model.safetensors"))
    (run / "checkpoints" / "latest").unlink()
    (run / "checkpoints" / "latest").symlink_to("step_0000009")
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_0000006", "step_0000009"]
    _corrupt(sorted((run / "checkpoints" / "step_0000009").glob("*.distcp"))[0])
    r = plait("train", "--resume", run, "--set", "train.steps=10")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "step_0000009 is damaged" in r.stdout and "resuming from" in r.stdout and "at step 6" in r.stdout
    assert max_diff(uninterrupted, weights(run)) <= 1e-6


@pytest.mark.slow
def test_a_stalled_rank_becomes_an_error_naming_it(job, tmp_path):
    # the launcher exits only once the stalled rank wakes (its sleep outlasts the SIGTERM it gets): a stall 3 s past
    # the 4 s timeout, not more
    r = plait("train", job, "--out", tmp_path / "run", "--set", "launch.timeout_s=4",
              faults="stall:rank=1:step=3:seconds=7", timeout=120)
    assert r.returncode == 3
    assert ("error: rank 0, step 3 (forward_backward): all_reduce did not finish within launch.timeout_s = 4 s; "
            "did not join: rank 1 (last seen: step 3 (data)") in r.stderr


@pytest.mark.slow
def test_mismatched_collectives_name_ranks_ops_and_call_sites(job, tmp_path):
    r = plait("train", job, "--out", tmp_path / "run", "--set", "launch.check_collectives=true",
              faults="mismatch:rank=1:step=3", timeout=120)
    assert r.returncode == 3
    # whichever rank notices first reports; the agent then stops the other
    line = next(x for x in r.stderr.splitlines() if "ranks issued different collectives" in x)
    assert "step 3 (" in line
    assert "rank 0 runs all_reduce of float32 shape [" in line and "(called at parallel/base.py:" in line
    assert "rank 1 runs broadcast of float32 shape [3] (called at faults.py:" in line


def _rank0_with_faults(cfg, run_dir, faults: str):
    """Pool task: rank0_params with PLAIT_FAULTS set on this rank (the session's pool outlives the test)."""
    from helpers import rank0_params

    os.environ["PLAIT_FAULTS"] = faults
    try:
        return rank0_params(cfg, run_dir)
    finally:
        os.environ.pop("PLAIT_FAULTS", None)


def test_a_slow_rank_is_flagged_as_a_straggler(pool2, tiny_text, tmp_path):
    from helpers import tiny_gpt_config

    pool2.run(_rank0_with_faults, tiny_gpt_config(tiny_text, "train.steps=6", "log.every=2"), tmp_path,
              "slow:rank=1:seconds=0.6")  # well over a loaded machine's step (flagged at 3x the other's: 2 ranks)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    # (step 2 is DDP's bucket rebuild, whose waiting happens in C++ collectives that are not timed)
    steady = [r for r in rows if r["step"] >= 4]
    assert len(steady) == 2 and all(r.get("stragglers") == [1] for r in steady)
    assert all(r["rank_compute_s"][1] > 0.5 > r["rank_compute_s"][0] for r in steady)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stragglers"]["flagged_windows_per_rank"]["1"] >= 2
    assert "0" not in summary["stragglers"]["flagged_windows_per_rank"]


def _free_port() -> int:
    from helpers import free_port

    return free_port()


@pytest.mark.slow
def test_a_node_that_joins_grows_the_job_and_one_that_dies_shrinks_it_on_one_trajectory(job, uninterrupted, tmp_path):
    """Two 1-process 'nodes' (launchers on loopback), nnodes = 1:2. Node 0 starts alone; node 1 joins after its first
    step: the workers checkpoint and the job re-forms with 2 ranks (dp 1 x 2 accumulation -> dp 2). Once that job
    has taken a step, node 1 dies (agent and worker): node 0 restarts from the latest checkpoint and finishes alone.
    The weights are the uninterrupted run's."""
    run, port = tmp_path / "run", _free_port()
    common = [sys.executable, "-m", "plait", "train", str(job), "--out", str(run), "--set", "launch.nnodes='1:2'",
              "--set", f"launch.rdzv_endpoint=127.0.0.1:{port}", "--set", "launch.max_restarts=1",
              "--set", "launch.timeout_s=20", "--set", "launch.heartbeat_s=2"]  # node 1's death: seen in ~6 s
    # Waits on events, not clocks: alone (world 1), node 0 waits at step 2 until it is asked to stop, which is node 1
    # joining (the agent re-forms the job); at 2 ranks, both wait at step 6 until node 1 has been killed. The faults
    # end with the first restart (node 1's death).
    dead = tmp_path / "node1-is-dead"
    env = {**ENV, "PLAIT_FAULTS": f"stall:step=2:world=1:until=stop:seconds=180;stall:step=6:world=2:until={dead}"
                                  ":seconds=180"}
    metrics = run / "metrics.jsonl"

    def wait_for(done, what):
        deadline = time.time() + 120
        while not (metrics.is_file() and done(metrics.read_text().splitlines())):
            assert time.time() < deadline and node0.poll() is None, f"no {what}: {node0.poll()}"
            time.sleep(0.2)

    node0 = subprocess.Popen(common + ["--set", "launch.node_rank=0"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    node1 = None
    try:
        wait_for(lambda lines: any(x.startswith('{"step": 1,') for x in lines), "first step")
        node1 = subprocess.Popen(common + ["--set", "launch.node_rank=1"], env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
        # a step of the 2-rank job: a step row after the second session's line
        wait_for(lambda lines: any('"world_size": 2' in x for x in lines) and lines[-1].startswith('{"step"') and
                 '"loss"' in lines[-1] and any('"world_size": 2' in x for x in lines[:-1]), "step at 2 ranks")
        for pid in process_tree(node1.pid):  # the whole node: its agent and its worker (in a session of its own)
            os.kill(pid, signal.SIGKILL)
        dead.touch()
        out, _ = node0.communicate(timeout=240)
    finally:
        for p in (node0, node1):
            if p is not None and p.poll() is None:
                p.kill()
    assert node0.returncode == 0, out
    assert out.count("world size is 1 (the config asks for 2): data parallel 2 -> 1, accumulation 1 -> 2") == 2, out
    assert re.search(r"preempted \(SIGTERM\): stopped cleanly at step_\d+; continue with", out), out
    sessions = [json.loads(x) for x in metrics.read_text().splitlines() if '"event": "session"' in x]
    assert [x["world_size"] for x in sessions] == [1, 2, 1], sessions
    assert [x["restart_count"] for x in sessions] == [0, 0, 1], sessions  # joining is no restart; a lost node is
    assert 0 < sessions[1]["since_checkpoint_s"] < 60  # the pause for re-forming (the closing note reports it)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["steps"] == 10
    assert max_diff(uninterrupted, weights(run)) <= 1e-5


@pytest.mark.slow
def test_async_checkpoints_publish_and_resume(job, uninterrupted, tmp_path):
    run = tmp_path / "run"
    r = plait("train", job, "--out", run, "--set", "checkpoint.async=true", "--set", "launch.max_restarts=1",
              faults="kill:rank=1:step=8")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    stalls = [x for x in rows if "checkpoint_stall_s" in x]
    assert stalls and all(x["checkpoint_async"] for x in stalls)
    # the kill at step 8 finds step 3's checkpoint published, and step 6's unless its background write is still on:
    # the restart resumed from the newer of them
    resumed = re.findall(r"resuming from \S+/step_(\d{7}) at step (\d+)", r.stdout)
    assert len(resumed) == 1 and resumed[0][0] in ("0000003", "0000006") and int(resumed[0][0]) == int(resumed[0][1]), \
        r.stdout
    assert max_diff(uninterrupted, weights(run)) <= 1e-6
    ckpts = sorted((run / "checkpoints").glob("step_*"))
    assert [c.name for c in ckpts] == ["step_0000006", "step_0000009", "step_0000010"]  # every 3 and the end, keep 3
    for ckpt in ckpts:
        assert int(verify(ckpt)["step"]) == int(ckpt.name[5:])
        # the checkpoint format stays DCP's (no pickles of ours): one shard file per rank beside the metadata
        assert sorted(f.name for f in ckpt.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json",
                                                          "trainer_state.json"], ckpt
    # and plain torch reads it: the last one holds the uninterrupted run's weights
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(ckpts[-1])).read_metadata().state_dict_metadata
    model = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items() if k.startswith("model.")}
    dcp.load(model, checkpoint_id=str(ckpts[-1]))  # one process, no process group: DCP's single-process load
    assert max_diff(uninterrupted, {k.removeprefix("model."): v for k, v in model.items()}) <= 1e-6
