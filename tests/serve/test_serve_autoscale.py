"""--autoscale MIN:MAX: the policy as data on a fake clock, and the controller on real replica processes."""

import asyncio
import os
import re
import signal
import threading

import httpx
import numpy as np
import pytest

from plait.serve.entrypoints.server import ServerThread
from plait.serve.errors import ServeError
from plait.serve.fleet.autoscale import AutoscaleConfig, AutoscalePolicy
from plait.serve.service import ServeOptions
from serve_helpers import gather_posts, infer_json, mlp_run, poll  # noqa: F401

STEP = 0.1  # the fake clock's tick (the controller's TICK_S)


def simulate(cfg: AutoscaleConfig, load, seconds: float, current: int) -> list[tuple[float, int, str]]:
    """Drive the policy with load(t) ongoing requests; every change applied at once. Returns (t, replicas, reason)."""
    policy, changes = AutoscalePolicy(cfg), []
    for i in range(round(seconds / STEP) + 1):
        t = round(i * STEP, 3)
        policy.observe(t, load(t))
        d = policy.decide(t, current)
        assert cfg.min_replicas <= d.desired <= cfg.max_replicas
        if d.desired != current:
            changes.append((t, d.desired, d.reason))
            current = d.desired
    return changes


def test_a_ramp_scales_up_after_the_delay_and_down_after_the_longer_one():
    cfg = AutoscaleConfig(1, 4, target_ongoing=2, upscale_delay_s=1, downscale_delay_s=3, look_back_s=1)
    ramp = lambda t: 0 if t < 1 else 3 if t < 4 else 7 if t < 8 else 0  # noqa: E731
    # 3 ongoing from t=1: the 1 s mean passes 2 (-> 2 replicas proposed) at 1.7, granted once proposed for 1 s.
    # 7 from t=4 (not panic: 7 < 2 x 2 x 2): 3 proposed from 4.2, 4 from 4.8, each granted 1 s later.
    # Idle from 8: each step down once nothing larger was proposed in the last 3 s.
    assert simulate(cfg, ramp, 14, current=1) == [(2.7, 2, "upscale"), (5.2, 3, "upscale"), (5.8, 4, "upscale"),
                                                  (11.1, 3, "downscale"), (11.4, 2, "downscale"), (11.7, 1, "downscale")]


def test_a_burst_panics_at_once_and_never_passes_max():
    cfg = AutoscaleConfig(1, 3, target_ongoing=1, upscale_delay_s=5, downscale_delay_s=5, look_back_s=2)
    burst = lambda t: 50 if 1 <= t < 2 else 0  # noqa: E731
    # 50 ongoing on 1 replica: panic (>= 2 x 1 x 1), ceil(50 / 1) capped at MAX 3; down 5 s after the last 3 proposed.
    assert simulate(cfg, burst, 12, current=1) == [(1.0, 3, "panic"), (9.0, 1, "downscale")]


def test_flapping_load_is_damped_by_the_delays():
    flap = lambda t: 6 if int(t / 0.5) % 2 else 0  # noqa: E731  (6 ongoing 0.5 s on, 0.5 s off: a mean of 3)
    cfg = AutoscaleConfig(1, 4, target_ongoing=2, upscale_delay_s=1, downscale_delay_s=4, look_back_s=1)
    # the first 6 panics 1 -> 3; the mean's 2 replicas 4 s later; then 16 s of flapping change nothing
    assert simulate(cfg, flap, 20, current=1) == [(0.5, 3, "panic"), (4.0, 2, "downscale")]
    undamped = AutoscaleConfig(1, 4, target_ongoing=2, upscale_delay_s=0, downscale_delay_s=0, look_back_s=0)
    assert len(simulate(undamped, flap, 20, current=1)) == 40  # without delays and window: every flip, 3 <-> 1


def test_scale_to_zero_after_idle_and_cold_start_at_once():
    cfg = AutoscaleConfig(0, 2, target_ongoing=1, upscale_delay_s=2, downscale_delay_s=1, scale_to_zero_after_s=3,
                          look_back_s=1)
    load = lambda t: 1 if 0.5 <= t < 1 or 6 <= t < 6.5 else 0  # noqa: E731
    assert simulate(cfg, load, 12, current=0) == [(0.5, 1, "cold-start"), (3.9, 0, "scale-to-zero"),
                                                  (6.0, 1, "cold-start"), (9.4, 0, "scale-to-zero")]
    fresh = AutoscalePolicy(cfg)  # a server that has seen no request stays at zero
    fresh.observe(0.0, 0)
    assert fresh.decide(0.0, 0).desired == 0 and fresh.decide(0.0, 0).reason == "steady"


@pytest.mark.parametrize("flag, message", [
    ("4", "--autoscale '4' must be MIN:MAX, two integers, e.g. 0:4"),
    ("3:1", "--autoscale 3:1: need 0 <= MIN <= MAX and MAX >= 1"),
    ("0:0", "--autoscale 0:0: need 0 <= MIN <= MAX and MAX >= 1"),
])
def test_bad_autoscale_flags_are_named(flag, message):
    with pytest.raises(ServeError, match=re.escape(message)):
        ServeOptions(autoscale=flag).validate()
    with pytest.raises(ServeError, match="--autoscale MIN:MAX sets the replica count itself; drop --replicas and --pp"):
        ServeOptions(autoscale="1:2", replicas=2).validate()
    with pytest.raises(ServeError, match=r"--target-ongoing = 0.0 must be a finite number > 0"):
        ServeOptions(autoscale="1:2", target_ongoing=0.0).validate()


def metric(srv, name: str) -> float:
    text = httpx.get(f"{srv.url}/metrics").text
    return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))


@pytest.fixture(scope="module")
def server(mlp_run):  # noqa: F811
    opts = ServeOptions(autoscale="0:2", target_ongoing=1, upscale_delay_s=0.2, downscale_delay_s=0.5,
                        scale_to_zero_after_s=1.5, max_batch_size=4, max_delay_ms=2, timeout_ms=90_000)
    with ServerThread(mlp_run / "model.safetensors", opts) as srv:
        yield srv


def test_from_zero_a_burst_is_held_answered_and_counted(server, mlp_run):  # noqa: F811
    pool = server.service.executor
    assert pool.process_count == 0 and metric(server, "plait_replicas") == 0
    assert httpx.get(f"{server.url}/v2/health/ready").status_code == 200  # ready: requests are held, not refused
    seen, desired, done = [], [], threading.Event()
    registry = server.service.metrics.registry

    def watch():  # sampled while the burst runs: after it the autoscaler may already have scaled back to zero
        while not done.is_set():
            seen.append(pool.process_count)
            desired.append(registry.get_sample_value("plait_replicas_desired"))
            done.wait(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    x = np.random.default_rng(0).standard_normal((24, 1, 8, 8)).astype(np.float32)
    try:
        answers = asyncio.run(gather_posts(f"{server.url}/v2/models/mlp/infer", [infer_json(x[i:i + 1]) for i in range(24)]))
    finally:
        done.set()
        watcher.join()
    assert [r.status_code for r in answers] == [200] * 24  # nothing lost
    assert max(seen) <= 2 and pool.cold_starts  # never more than MAX processes
    index, split = pool.cold_starts[0]
    assert set(split) == {"process_s", "imports_s", "load_s"} and all(v > 0 for v in split.values())
    assert metric(server, "plait_cold_starts_total") >= 1
    for phase in ("process", "imports", "load", "total"):
        assert metric(server, f'plait_cold_start_seconds{{phase="{phase}"}}') > 0
    assert max(desired) >= 1 and server.service.autoscaler.history[0].reason == "cold-start"


def test_a_crashed_replica_is_replaced(server):
    pool = server.service.executor
    body = infer_json(np.zeros((1, 1, 8, 8), np.float32))
    assert httpx.post(f"{server.url}/v2/models/mlp/infer", json=body, timeout=90).status_code == 200
    pid = next(r.proc.pid for r in pool._replicas if r is not None and r.live and not r.retiring)
    before = pool.restarts
    slot = pool.pids().index(pid)
    os.kill(pid, signal.SIGKILL)
    poll(lambda: pool.restarts == before + 1, 30, "the restart")
    assert httpx.post(f"{server.url}/v2/models/mlp/infer", json=body, timeout=90).status_code == 200
    poll(lambda: pool.pids()[slot] not in (None, pid), 60, "the replacement in the dead replica's slot")
    assert pid not in pool.pids() and metric(server, "plait_replica_restarts_total") >= 1


def test_a_held_request_is_bounded_by_the_timeout(mlp_run):  # noqa: F811
    opts = ServeOptions(autoscale="0:1", timeout_ms=30)  # far less than a replica's cold start
    with ServerThread(mlp_run / "model.safetensors", opts) as srv:
        r = httpx.post(f"{srv.url}/v2/models/mlp/infer", json=infer_json(np.zeros((1, 1, 8, 8), np.float32)), timeout=30)
        assert r.status_code == 504 and r.json()["error"] == ("the request did not finish within --timeout-ms 30; its "
                                                              "work was dropped")
        assert srv.service.autoscaler.history[0].reason == "cold-start"  # it did start a replica meanwhile


def test_idle_goes_back_to_min(server):
    pool = server.service.executor
    poll(lambda: pool.process_count == 0, 30, "scale to zero")
    assert metric(server, "plait_replicas") == 0 and metric(server, "plait_replicas_desired") == 0
    reasons = [d.reason for d in server.service.autoscaler.history]
    assert reasons[0] == "cold-start" and reasons[-1] == "scale-to-zero"


def test_burst_idle_burst_loses_nothing_and_is_plotted(server, tmp_path):
    from plait.bench.serve import request_body
    from plait.bench.serve_burst import burst_load, plot_burst

    pool = server.service.executor
    poll(lambda: pool.process_count == 0, 30, "scale to zero before the bursts")
    body = request_body(server.service.served)
    phases = [("burst", 1.5), ("idle", 3.0), ("burst", 1.5)]  # the server scales to zero 1.5 s into the idle phase
    result = asyncio.run(burst_load("127.0.0.1", server.port, "/v2/models/mlp/infer", body, 4, phases))
    assert result.lost == 0 and result.answered == len(result.requests) >= 8  # each client: one or more per burst
    (_, _, b1), (_, i0, i1), (_, b2, _) = result.phases
    assert b1 == i0 and i1 - i0 >= 3.0 and b2 == i1  # one after the other; the idle phase idle for its whole length
    assert result.samples[0][1] == 0 and max(s[1] for s in result.samples) <= 2
    idle = [s[1] for s in result.samples if i1 - 0.5 <= s[0] < i1]  # the idle phase's last half second
    assert idle and max(idle) == 0 and result.samples[-1][1] >= 1  # zero between the bursts, up again for the second
    assert result.cold_starts >= 2 and set(result.cold_start) == {"process", "imports", "load", "total"}
    rows = result.timeline()
    assert {r["phase"] for r in rows} >= {"burst", "idle"} and rows[0]["answers"] > 0
    assert sum(r["answers"] for r in rows if r["phase"] == "idle") == 0  # nothing is sent while idle
    assert plot_burst(result, tmp_path / "burst.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
