"""Dynamic batching: the policy's decisions, the queue, backpressure (503), timeouts (504), and exact answers."""

import asyncio
import re
import threading
import time

import httpx
import numpy as np
import pytest
import torch

from plait.serve.entrypoints.server import ServerThread
from plait.serve.executor.batcher import Batcher, BatchPolicy, Decision, QueueFull
from plait.serve.executor.runner import Runner
from plait.serve.model.load import ModelRef, load_model
from plait.serve.service import ServeOptions, Service
from serve_helpers import cnn_run, gather_posts, infer_json, mlp_run  # noqa: F401


def test_policy_decisions_are_data():
    p = BatchPolicy(max_batch_size=4, max_delay_ms=10, max_queue=3)
    assert p.decide(4, 0.0) == Decision(True, 0.0)  # full
    assert p.decide(9, 0.0) == Decision(True, 0.0)
    d = p.decide(1, 0.004)
    assert not d.run and d.wait_s == pytest.approx(0.006)
    assert p.decide(1, 0.010) == Decision(True, 0.0)  # waited long enough
    assert BatchPolicy(max_batch_size=1).decide(1, 0.0).run  # batching off: at once
    assert [p.admit(n) for n in (0, 2, 3, 4)] == [True, True, False, False]
    for kwargs, message in (({"max_batch_size": 0}, "max_batch_size must be >= 1 (1 turns batching off), got 0"),
                            ({"max_delay_ms": -1}, "max_delay_ms must be >= 0, got -1"),
                            ({"max_queue": 0}, "max_queue must be >= 1, got 0")):
        with pytest.raises(ValueError, match=re.escape(message)):
            BatchPolicy(**kwargs)


def run_batcher(policy: BatchPolicy, script, capacity: int = 1):
    """Run `script(batcher, batches, gate)` on a fresh loop; batches records (keys, payloads, rows, cut time)."""
    async def main():
        batches, gate = [], asyncio.Event()
        gate.set()

        async def run_batch(batch):
            batches.append(([p.key for p in batch], [p.payload for p in batch], sum(p.rows for p in batch), time.monotonic()))
            await gate.wait()
            for p in batch:
                if not p.future.done():
                    p.future.set_result(p.payload)

        b = Batcher(policy, run_batch, capacity)
        b.start()
        try:
            return await script(b, batches, gate)
        finally:
            gate.set()
            await b.stop()

    return asyncio.run(main())


def test_full_batch_at_once_rest_after_delay_kinds_never_mix():
    async def script(b, batches, gate):
        t0 = time.monotonic()
        items = [b.submit("a", 0, 2), b.submit("b", 1, 1), b.submit("a", 2, 2), b.submit("a", 3, 1)]
        await asyncio.gather(*(p.future for p in items))
        return t0, batches

    t0, batches = run_batcher(BatchPolicy(max_batch_size=4, max_delay_ms=150), script)
    assert [(keys, payloads, rows) for keys, payloads, rows, _ in batches] == [
        (["a", "a"], [0, 2], 4),  # 4 rows of kind a: full, cut at once (request 3 would overflow it)
        (["b"], [1], 1),  # the oldest waiting request is now b: cut after its delay
        (["a"], [3], 1),
    ]
    assert batches[0][3] - t0 < 0.1
    assert batches[1][3] - t0 >= 0.15 and batches[2][3] - t0 >= 0.15


def test_busy_executor_lets_the_next_batch_grow_and_cancelled_work_is_dropped():
    async def script(b, batches, gate):
        gate.clear()
        first = b.submit("k", "first", 1)
        while not batches:  # the first batch is running (and held by the gate)
            await asyncio.sleep(0.005)
        later = [b.submit("k", i, 1) for i in range(3)]
        b.cancel(later[1])
        assert b.depth == 3
        gate.set()
        await first.future
        await asyncio.gather(later[0].future, later[2].future)
        assert later[1].future.cancelled()
        return batches

    batches = run_batcher(BatchPolicy(max_batch_size=8, max_delay_ms=0), script)
    assert [payloads for _, payloads, _, _ in batches] == [["first"], [0, 2]]


def test_full_queue_refuses_at_once():
    async def script(b, batches, gate):
        gate.clear()
        b.submit("k", 0, 1)
        while not batches:
            await asyncio.sleep(0.005)
        b.submit("k", 1, 1)
        b.submit("k", 2, 1)
        with pytest.raises(QueueFull, match=re.escape("the queue holds 2 requests (max_queue = 2)")):
            b.submit("k", 3, 1)
        return True

    assert run_batcher(BatchPolicy(max_batch_size=1, max_delay_ms=0, max_queue=2), script)


class GatedExecutor:
    """Runs batches on the real model, but only once the test opens the gate; records what it ran."""

    capacity, restarts = 1, 0

    def __init__(self, runner: Runner):
        self.runner, self.gate, self.seen = runner, threading.Event(), []

    async def start(self) -> None:
        pass

    def ready(self) -> bool:
        return True

    async def run(self, task, on_event=None, cancelled=None):
        self.seen += [float(v) for v in task.inputs.reshape(len(task.inputs), -1)[:, 0]]
        await asyncio.get_running_loop().run_in_executor(None, self.gate.wait, 60)
        return self.runner.run(task)

    async def stop(self) -> None:
        self.gate.set()


async def apoll(predicate, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.005)


def test_backpressure_503_and_timeout_504_drop_the_work(mlp_run):  # noqa: F811
    opts = ServeOptions(max_batch_size=1, max_delay_ms=0, max_queue=2, timeout_ms=1500)
    service = Service(str(mlp_run / "model.safetensors"), opts)
    gated = service.executor = GatedExecutor(Runner(service.served))
    url = None

    def body(v: float) -> dict:
        return infer_json(np.full((1, 1, 8, 8), v, dtype=np.float32))

    async def scenario():
        async with httpx.AsyncClient(timeout=30) as c:
            post = lambda v: c.post(url, json=body(v))
            a = asyncio.create_task(post(1))
            await apoll(lambda: gated.seen == [1.0])  # a is running, held by the gate
            b, cc = asyncio.create_task(post(2)), asyncio.create_task(post(3))
            await apoll(lambda: service.batcher.depth == 2)
            t0 = time.monotonic()
            d = await post(4)
            refused_in = time.monotonic() - t0
            timed_out = await asyncio.gather(a, b, cc)
            gated.gate.set()
            after = await post(5)
            return d, refused_in, timed_out, after

    with ServerThread(None, service=service) as srv:
        url = srv.url + "/v2/models/mlp/infer"
        d, refused_in, timed_out, after = asyncio.run(scenario())
        metrics = httpx.get(srv.url + "/metrics").text
    assert d.status_code == 503 and d.headers["retry-after"] == "1" and refused_in < 0.5
    assert d.json()["error"] == "server busy: the queue holds 2 requests (max_queue = 2); retry later"
    for r in timed_out:
        assert r.status_code == 504
        assert r.json()["error"] == "the request did not finish within --timeout-ms 1500; its work was dropped"
    assert after.status_code == 200
    assert gated.seen == [1.0, 5.0]  # the queued requests that timed out never ran
    assert 'plait_rejected_total{reason="queue_full"} 1.0' in metrics
    assert 'plait_rejected_total{reason="timeout"} 3.0' in metrics


def test_exact_sizes_hold_at_any_offset(mlp_run):  # noqa: F811
    """Every size the probe accepts gives rows the bits of the full batch, at any place in the batch."""
    runner = Runner(load_model(ModelRef(str(mlp_run))), pad_to=16)
    runner.prepare()
    assert runner.sizes[-1] == 16 and runner.padded(16) == 16
    assert all(runner.padded(n) >= n and runner.padded(n) in runner.sizes for n in range(1, 17))
    model = runner.served.module
    x = torch.randn(16, 1, 8, 8, generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        full = model(x)
        for m in runner.sizes:
            for at in (0, (16 - m) // 2, 16 - m):
                assert torch.equal(model(x[at:at + m]), full[at:at + m]), (m, at)


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_batched_answers_are_bitwise_the_lone_answers(kind, request):
    path = request.getfixturevalue(f"{kind}_run") / "model.safetensors"
    rng = np.random.default_rng(1)
    rows = [1, 3, 1, 2, 1]  # 8 rows: one full batch
    xs = [rng.standard_normal((n, 1, 8, 8)).astype(np.float32) for n in rows]
    bodies = [infer_json(x) | {"id": str(i)} for i, x in enumerate(xs)]
    with ServerThread(path, ServeOptions(max_batch_size=8, max_delay_ms=5000)) as merged:
        together = asyncio.run(gather_posts(merged.url + f"/v2/models/{kind}/infer", bodies))
        metrics = httpx.get(merged.url + "/metrics").text
    assert "plait_batch_size_count 1.0" in metrics and "plait_batch_size_sum 8.0" in metrics  # all in one batch
    with ServerThread(path, ServeOptions(max_batch_size=8, max_delay_ms=0)) as lone:
        with httpx.Client() as c:
            alone = [c.post(lone.url + f"/v2/models/{kind}/infer", json=b) for b in bodies]
    for x, t, a in zip(xs, together, alone):
        assert t.status_code == a.status_code == 200
        lt = np.array(t.json()["outputs"][0]["data"], dtype=np.float32)
        la = np.array(a.json()["outputs"][0]["data"], dtype=np.float32)
        assert lt.shape == (len(x) * 10,)
        assert lt.tobytes() == la.tobytes()  # bitwise
        assert t.json()["outputs"][1]["data"] == a.json()["outputs"][1]["data"]


def test_strict_blas_lets_a_lone_request_run_as_one_row(mlp_run):  # noqa: F811
    """`plait serve` asks MKL for strict reproducibility before its first matrix product: every batch size is then
    exact, so a lone request runs unpadded (without it the sizes are whatever the probe finds on this CPU)."""
    import subprocess
    import sys

    from plait.serve.executor.runner import intel_cpu

    if not torch.backends.mkl.is_available():
        pytest.skip("this torch has no MKL: MKL_CBWR has no effect, the probe decides the sizes alone")
    if not intel_cpu():
        pytest.skip("not an Intel CPU: MKL's strict mode is not asked for (test_blas_mode_by_processor)")
    probe = ("import sys; from plait.serve.executor.runner import strict_blas, Runner; "
             "from plait.serve.model.load import ModelRef, load_model; strict_blas() if sys.argv[1] == 'strict' else None; "
             "r = Runner(load_model(ModelRef(sys.argv[2])), pad_to=16); r.prepare(); print(r.padded(1), r.sizes)")
    env = {k: v for k, v in __import__("os").environ.items() if k != "MKL_CBWR"}
    rows, sizes = subprocess.run([sys.executable, "-c", probe, "strict", str(mlp_run)], env=env, capture_output=True,
                                 text=True, check=True).stdout.split(" ", 1)
    assert rows == "1" and sizes.strip() == str(list(range(1, 17)))


@pytest.mark.parametrize("vendor, flags, exact, want", [
    ("GenuineIntel", {"avx2"}, True, "AUTO,STRICT"),  # strict: every batch size exact, a lone request one row
    ("GenuineIntel", {"avx2"}, False, None),  # --no-exact-batching on Intel: MKL's own choice
    ("AuthenticAMD", {"avx2", "fma"}, True, "AVX2"),  # MKL's automatic path is ~2x slower for a few rows there
    ("AuthenticAMD", {"avx2"}, False, "AVX2"),  # a speed choice, in either mode
    ("AuthenticAMD", {"sse4_2"}, True, None),  # no AVX2: left alone
    ("", set(), True, None),  # unknown (no /proc/cpuinfo)
])
def test_blas_mode_by_processor(monkeypatch, vendor, flags, exact, want):
    from plait.serve.executor import runner

    monkeypatch.delenv("MKL_CBWR", raising=False)
    monkeypatch.setattr(runner, "_cpuinfo", lambda: (vendor, flags))
    assert runner.strict_blas(exact=exact) is (want is not None)
    assert __import__("os").environ.get("MKL_CBWR") == want
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")  # the user's choice stands
    assert runner.strict_blas(exact=exact) is False and __import__("os").environ["MKL_CBWR"] == "COMPATIBLE"


def test_the_cpuinfo_reader_names_this_processor():
    from plait.serve.executor.runner import _cpuinfo

    if not __import__("os").path.exists("/proc/cpuinfo"):
        pytest.skip("no /proc/cpuinfo here")
    vendor, flags = _cpuinfo()
    lines = open("/proc/cpuinfo").read().splitlines()
    assert vendor == next(x.split(":", 1)[1].strip() for x in lines if x.startswith("vendor_id"))
    assert flags == set(next(x.split(":", 1)[1] for x in lines if x.startswith("flags")).split())
