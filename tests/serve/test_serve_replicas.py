"""Replica processes: answers equal the in-process ones; a replica killed under load is replaced and nothing hangs."""

import asyncio
import json
import os
import signal
import threading

import httpx
import numpy as np
import pytest
import torch

from plait.export import load_exported
from plait.serve.entrypoints.server import ServerThread
from plait.serve.executor.tasks import Token
from plait.serve.service import ServeOptions
from serve_helpers import gpt_run, poll  # noqa: F401

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(gpt_run):  # noqa: F811
    with ServerThread(gpt_run / "model.safetensors", ServeOptions(replicas=2, max_batch_size=4, max_delay_ms=1)) as srv:
        yield srv
    assert not any(p.is_alive() for p in _procs(srv))  # every replica process is gone


def _procs(srv):
    return [r.proc for r in srv.service.executor._replicas if r is not None]


@pytest.fixture(scope="module")
def model(gpt_run):  # noqa: F811
    return load_exported(gpt_run / "model.safetensors")[0].eval()


@pytest.fixture(scope="module")
def tok(gpt_run):  # noqa: F811
    from plait.data.tokenizer import CharTokenizer

    return CharTokenizer.from_json(load_exported(gpt_run / "model.safetensors")[1]["plait.tokenizer"])


def greedy(model, tok, text: str, n: int) -> list[int]:
    ids = torch.tensor(tok.encode(text).astype("int64"))[None]
    return model.generate(ids, n, temperature=0)[0, ids.shape[1]:].tolist()


def logits_body(ids: np.ndarray) -> dict:
    return {"inputs": [{"name": "input_ids", "shape": list(ids.shape), "datatype": "INT64", "data": ids.reshape(-1).tolist()}]}


def running_on(srv, kind: str, attempt: int) -> int | None:
    """Process id of the replica running a `kind` batch on its `attempt`-th try, if any."""
    pool = srv.service.executor
    for pid, tasks in zip(pool.pids(), pool.running()):
        if (kind, attempt) in tasks:
            return pid
    return None


def test_replicas_answer_like_the_model(server, model):
    ids = np.random.default_rng(0).integers(0, model.head.out_features, (3, 10)).astype(np.int64)
    r = httpx.post(server.url + "/v2/models/gpt/infer", json=logits_body(ids), timeout=60)
    logits = torch.tensor(r.json()["outputs"][0]["data"]).view(3, 10, -1)
    torch.testing.assert_close(logits, model(torch.from_numpy(ids)), rtol=0, atol=1e-5)
    assert server.service.executor.pids()[0] != server.service.executor.pids()[1]
    assert httpx.get(server.url + "/v2/models/gpt").json()["parameters"]["layout"] == "2 replica process(es)"


def test_killed_replica_under_load_is_retried_and_replaced(server, model, tok, capfd):
    pool, url = server.service.executor, server.url
    want = greedy(model, tok, "def ", 300)
    stop, codes = threading.Event(), []
    ids = np.random.default_rng(1).integers(0, model.head.out_features, (1, 8)).astype(np.int64)

    async def load():  # 4 clients, closed loop, until told to stop
        async with httpx.AsyncClient(timeout=60) as c:
            async def client():
                while not stop.is_set():
                    r = await c.post(url + "/v2/models/gpt/infer", json=logits_body(ids))
                    codes.append((r.status_code, r.text if r.status_code != 200 else ""))
            await asyncio.gather(*(client() for _ in range(4)))

    loader = threading.Thread(target=asyncio.run, args=(load(),))
    loader.start()
    tokens, killed = [], []
    try:
        body = {"prompt": "def ", "max_new_tokens": 300, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/generate", json=body, timeout=60) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: ") and "index" in line:
                    tokens.append(json.loads(line[6:])["token"])
                    if not killed:  # mid-stream: kill the replica generating it
                        victim = running_on(server, "generate", 1)
                        assert victim is not None
                        killed.append(victim)
                        os.kill(victim, signal.SIGKILL)
                elif line.startswith("event: done"):
                    done = json.loads(next(lines)[6:])
    finally:
        stop.set()
        loader.join(60)
    assert not loader.is_alive()
    assert tokens == want and done["tokens"] == want  # the retry on the other replica continued the same stream
    assert len(codes) > 0 and all(c == 200 for c, _ in codes), [c for c in codes if c[0] != 200][:3]
    poll(lambda: pool.restarts == 1 and None not in pool.pids(), 120, "the replacement replica")
    assert killed[0] not in pool.pids()
    assert f"(pid {killed[0]}) exited with code -9; restarting it" in capfd.readouterr().err  # said, not silent
    assert "plait_replica_restarts_total 1.0" in httpx.get(url + "/metrics").text


def test_a_batch_whose_retry_dies_too_gets_a_clear_503(server, model, tok):
    pool, url = server.service.executor, server.url
    poll(lambda: None not in pool.pids(), 120, "both replicas up")
    result = {}

    def ask():
        body = {"prompt": "import ", "max_new_tokens": 1024, "temperature": 0}
        result["r"] = httpx.post(url + "/v1/generate", json=body, timeout=120)

    t = threading.Thread(target=ask)
    t.start()
    for attempt in (1, 2):
        victim = poll(lambda a=attempt: running_on(server, "generate", a), 60, f"attempt {attempt}")
        os.kill(victim, signal.SIGKILL)
    t.join(120)
    r = result["r"]
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert "died with exit code -9 while running this request, after another replica had died running it too; " \
           "nothing was answered, send it again" in r.json()["error"]
    poll(lambda: None not in pool.pids(), 120, "both replicas replaced")
    again = httpx.post(url + "/v1/generate", json={"prompt": "x", "max_new_tokens": 3, "temperature": 0}, timeout=60)
    assert again.status_code == 200 and again.json()["tokens"] == greedy(model, tok, "x", 3)


def test_a_dropped_stream_or_a_504_stops_the_replicas_work(server):
    """docs/security.md row 10: with --replicas, a disconnected stream or a 504 left the replica generating."""
    pool, url = server.service.executor, server.url
    poll(lambda: None not in pool.pids(), 120, "both replicas up")
    events = []
    real = pool._on_message

    def counting(r, msg):
        if isinstance(msg, Token):
            events.append(msg.task_id)
        real(r, msg)

    pool._on_message = counting  # the reader threads look it up on each message
    try:
        body = {"prompt": "def ", "max_new_tokens": 1024, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/generate", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # one token, then the client goes away
        poll(lambda: not any(pool.running()), 30, "the replica to give the stream up")
        streamed = len(events)
        events.clear()
        server.service.opts.timeout_ms = 50.0
        try:
            r = httpx.post(url + "/v1/generate", json={"prompt": "x", "max_new_tokens": 1024, "temperature": 0}, timeout=60)
        finally:
            server.service.opts.timeout_ms = 30_000.0
        assert r.status_code == 504
        poll(lambda: not any(pool.running()), 30, "the replica to give the timed-out request up")
        timed_out = len(events)
    finally:
        del pool._on_message
    assert streamed < 600 and timed_out < 600, (streamed, timed_out)  # all 1024 were generated before (~150 now)
    again = httpx.post(url + "/v1/generate", json={"prompt": "x", "max_new_tokens": 3, "temperature": 0}, timeout=60)
    assert again.status_code == 200
