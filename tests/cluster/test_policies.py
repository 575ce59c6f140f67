"""Scheduling policies on hand-made queues, and the simulator against completion times worked out by hand."""

from __future__ import annotations

import json

import pytest

from plait.cli import main
from plait.cluster.policies import JobView, Params, decide, tiresias_queue
from plait.cluster.sim import TraceJob, simulate
from plait.cluster.trace import read_trace, synthetic
from plait.errors import ConfigError


def J(id, arrival, devices, remaining=100.0, **kw):
    return JobView(id, arrival, devices, remaining, **kw)


def test_fifo_never_preempts_and_its_head_blocks_the_queue():
    jobs = [J("a", 0, 2, running=True), J("b", 1, 4), J("c", 2, 1)]
    d = decide("fifo", 5, jobs, 4)
    assert (d.keep, d.start, d.preempt) == (["a"], [], [])  # c would fit, but b is first in line


def test_srtf_preempts_for_the_shortest_and_backfills():
    jobs = [J("long", 0, 2, 500, running=True), J("short", 3, 2, 10), J("tiny", 4, 1, 1), J("mid", 1, 1, 50)]
    d = decide("srtf", 5, jobs, 4)
    assert (d.start, d.preempt, d.keep) == (["mid", "short", "tiny"], ["long"], [])


def test_tiresias_orders_by_attained_service_then_arrival_and_promotes_the_starved():
    p = Params(thresholds=(100.0,), promote=2.0)
    old = J("old", 0, 2, attained=150.0, executed=75.0, running=True)
    new = J("new", 10, 2)
    assert tiresias_queue(old, 20, p) == 1 and tiresias_queue(new, 20, p) == 0
    d = decide("tiresias", 20, [old, new], 2, p)
    assert (d.start, d.preempt) == (["new"], ["old"])
    waited = J("waited", 0, 2, attained=150.0, executed=75.0, waiting_since=20.0)  # 2 x 75 s: promoted at t=170
    assert tiresias_queue(waited, 169, p) == 1 and tiresias_queue(waited, 171, p) == 0
    later = J("later", 5, 2, running=True, slice_start=100)
    assert decide("tiresias", 171, [waited, later], 2, p).start == ["waited"]


def test_gandiva_keeps_a_turn_for_a_quantum_then_lets_the_least_recent_run():
    p = Params(quantum=60.0)
    a = J("a", 0, 1, running=True, slice_start=0.0, last_run=50.0)
    b = J("b", 1, 1, last_run=-1.0)
    assert decide("gandiva", 50, [a, b], 1, p).keep == ["a"]
    d = decide("gandiva", 60, [a, b], 1, p)
    assert (d.start, d.preempt) == (["b"], ["a"])


def test_an_unknown_policy_names_the_choices():
    with pytest.raises(ConfigError, match="--policy 'lifo' is not a policy; choose one of fifo, srtf, tiresias, gandiva"):
        decide("lifo", 0, [], 1)


# A 100-second job at t=0 and a 10-second one at t=10 on one device: every policy's completion times by hand.
TWO = [TraceJob("A", 0, 1, 100), TraceJob("B", 10, 1, 10)]


@pytest.mark.parametrize("policy, params, switch, finish, preempted", [
    ("fifo", Params(), 0, {"A": 100, "B": 110}, 0),
    ("srtf", Params(), 0, {"A": 110, "B": 20}, 1),          # B preempts A at 10
    ("srtf", Params(), 5, {"A": 115, "B": 20}, 1),          # A restores its checkpoint for 5 s
    ("tiresias", Params(thresholds=(50.0,)), 0, {"A": 110, "B": 60}, 1),  # A drops a queue at 50 device-seconds
    ("gandiva", Params(quantum=30.0), 0, {"A": 110, "B": 40}, 1),          # A's turn ends at 30
])
def test_the_simulator_matches_completion_times_worked_by_hand(policy, params, switch, finish, preempted):
    r = simulate(TWO, 1, policy, params, switch)
    assert {j.id: j.finish for j in r.jobs} == pytest.approx(finish)
    assert sum(j.preemptions for j in r.jobs) == preempted
    assert r.makespan == pytest.approx(max(finish.values()))
    assert r.useful == pytest.approx(110)  # every second of work done once
    assert r.busy == pytest.approx(110 + switch)


def test_a_synthetic_trace_every_policy_finishes_every_job_within_capacity():
    trace = synthetic(200, 16, seed=1)
    work = sum(j.devices * j.duration for j in trace)
    for p in ("fifo", "srtf", "tiresias", "gandiva"):
        r = simulate(trace, 16, p, keep_segments=True)
        assert all(j.finish >= j.arrival + j.duration - 1e-6 for j in r.jobs)
        assert r.useful == pytest.approx(work, rel=1e-6)
        # at no moment do the segments hold more than the 16 devices
        edges = sorted({t for _, s, e, _ in r.segments for t in (s, e)})
        for a, b in zip(edges, edges[1:]):
            mid = (a + b) / 2
            assert sum(g for _, s, e, g in r.segments if s <= mid < e) <= 16
    fifo, tiresias = (simulate(trace, 16, p).avg_jct for p in ("fifo", "tiresias"))
    assert tiresias < fifo


def test_plait_cluster_simulate_prints_the_table_and_writes_results(tmp_path, capsys):
    csv = tmp_path / "jobs.csv"
    csv.write_text("id,arrival,devices,duration\nA,0,1,100\nB,10,1,10\n")
    assert main(["cluster", "simulate", "--trace", str(csv), "--devices", "1", "--policy", "fifo,srtf",
                 "--switch-cost", "0", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "fifo avg JCT / it" in out and "1.67x" in out  # fifo's 100 s average against srtf's 60 s
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["avg_jct_s"] for r in res["policies"]] == pytest.approx([100.0, 60.0])
    assert (tmp_path / "out" / "jct_cdf.png").stat().st_size > 1000


@pytest.mark.parametrize("text, message", [
    ("id,arrival,devices,duration\nA,0,two,10\n", r"jobs.csv, row 2, column devices: 'two' is not a whole number"),
    ("id,arrival,devices\nA,0,1\n", r"has no column 'duration'; its columns are id, arrival, devices"),
    ("id,arrival,devices,duration\nA,0,1,0\n", r"row 2, column duration: 0.0 must be > 0"),
    ("id,arrival,devices,duration\nA,0,1,5\nA,1,1,5\n", r"job id 'A' appears twice"),
])
def test_a_bad_trace_names_the_file_row_and_column(tmp_path, text, message):
    f = tmp_path / "jobs.csv"
    f.write_text(text)
    with pytest.raises(ConfigError, match=message):
        read_trace(f)


def test_a_job_larger_than_the_cluster_is_refused(tmp_path, capsys):
    f = tmp_path / "jobs.csv"
    f.write_text("id,arrival,devices,duration\nbig,0,8,5\n")
    assert main(["cluster", "simulate", "--trace", str(f), "--devices", "4"]) == 2
    assert "job big needs 8 devices but the cluster has 4" in capsys.readouterr().err
