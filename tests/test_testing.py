"""The shipped test harness: results per rank, tracebacks tagged by rank, hangs turned into errors."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from plait.testing import DistributedError, RankPool, run_distributed


def all_reduce_rank(offset):
    t = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(t)
    return t.item(), dist.get_world_size(), os.environ["OMP_NUM_THREADS"], os.environ["GLOO_SOCKET_IFNAME"]


def fail_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("boom from rank one")
    return "fine"


def stall_on_rank_1():
    if dist.get_rank() == 1:
        time.sleep(30)
        return "late"
    dist.barrier()  # rank 1 never joins: the collective's timeout turns the hang into an error


def die_on_rank_1_and_say_so_on_rank_0():
    if dist.get_rank() == 1:
        os._exit(3)
    time.sleep(1.0)  # longer than the harness's poll: it sees rank 1 dead before rank 0 answers
    raise RuntimeError("rank 1 stopped answering")


def pid():
    return os.getpid()


def test_run_distributed_returns_each_ranks_result():
    assert run_distributed(all_reduce_rank, 3, 10) == [(33.0, 3, "1", "lo")] * 3


def test_a_rank_exception_is_raised_with_its_rank_and_traceback():
    with pytest.raises(DistributedError) as e:
        run_distributed(fail_on_rank_1, 2)
    text = str(e.value)
    assert "fail_on_rank_1 failed on rank(s) [1]" in text
    assert "[rank 1] ValueError: boom from rank one" in text
    assert "[rank 0]" not in text


def test_a_hang_becomes_an_error_naming_the_rank(monkeypatch):
    import plait.testing

    # Once rank 0 has failed, how long the harness waits for rank 1 (5 s by default): rank 1 sleeps 30 s either way.
    monkeypatch.setattr(plait.testing, "FAILURE_GRACE_S", 1.0)
    with pytest.raises(DistributedError) as e:
        run_distributed(stall_on_rank_1, 2, timeout_s=3)
    text = str(e.value)
    assert "[rank 0]" in text and "[rank 1] did not finish" in text  # rank 0 timed out waiting for rank 1


def test_a_dead_rank_waits_for_the_living_ones_to_say_why():
    with pytest.raises(DistributedError) as e:
        run_distributed(die_on_rank_1_and_say_so_on_rank_0, 2)
    text = str(e.value)
    assert "[rank 1] process exited with code 3" in text
    assert "RuntimeError: rank 1 stopped answering" in text


def test_pool_keeps_ranks_alive_and_restarts_after_a_failure():
    with RankPool(2) as pool:
        first = pool.run(pid)
        assert pool.run(pid) == first  # the same processes serve the next call
        with pytest.raises(DistributedError):
            pool.run(fail_on_rank_1)
        again = pool.run(all_reduce_rank, 0)
        assert again[0][0] == 1.0 and pool.run(pid) != first  # fresh ranks after the failure


def test_ranks_exit_when_their_pool_process_dies():
    """An interrupted test session (its process killed) leaves no rank behind waiting for tasks."""
    import os
    import signal
    import subprocess
    import sys
    import time

    code = ("import os, time\nfrom plait.testing import RankPool\npool = RankPool(2, timeout_s=30)\n"
            "print(' '.join(map(str, pool.run(os.getpid))), flush=True)\ntime.sleep(600)\n")
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 2
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=30)

        def alive(pid):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped by init) counts as gone
                return f.read().split()[2] != "Z"

        deadline = time.monotonic() + 20
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [p for p in pids if alive(p)] == []
    finally:
        owner.kill()


def test_a_pool_starts_fresh_ranks_when_recycled_after_recycle_after_tasks():
    with RankPool(2, recycle_after=2) as pool:
        first = pool.run(pid)
        pool.recycle_if_due()  # one task: not yet
        second, third = pool.run(pid), pool.run(pid)  # never in the middle of a caller's tasks
        pool.recycle_if_due()
        fourth = pool.run(pid)
    assert first == second == third and set(fourth).isdisjoint(first)
