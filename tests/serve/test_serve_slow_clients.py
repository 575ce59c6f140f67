"""The third audit pass's serving rows (docs/security.md, issue 37): each attack replayed on a real socket, the defence
asserted with numbers. N5: slow bodies holding every connection slot; F9: a body of millions of empty arrays;
N15: a head over the limit in one write, and requests given up during a cold start."""

import json
import re
import socket
import threading
import time

import httpx
import numpy as np
import pytest

import plait.serve.fleet.replicas as replicas_module
from plait.serve.entrypoints.app import MAX_HEAD_BYTES
from plait.serve.entrypoints.protocol import MAX_JSON_CONTAINERS, check_items
from plait.serve.entrypoints.server import ServerThread
from plait.serve.errors import RequestError
from plait.serve.model.signature import TensorSpec, request_items
from plait.serve.service import ServeOptions
from serve_helpers import infer_json, mlp_run, poll  # noqa: F401

HEAD = b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def probe(port: int, timeout: float = 5.0) -> tuple[bytes, float]:
    """One GET /v2/health/live on a new connection: the answer's first bytes and how long it took."""
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            data = s.recv(4096)
        except ConnectionResetError:
            data = b""
    return data, time.perf_counter() - t0


def answer(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


@pytest.fixture(scope="module")
def server(mlp_run):  # noqa: F811
    with ServerThread(mlp_run / "model.safetensors", ServeOptions(max_delay_ms=0)) as srv:
        yield srv


# ------------------------------------------------------------------ N5: slow bodies hold every slot

def test_slow_bodies_are_cut_at_a_total_deadline_and_health_is_answered_meanwhile(mlp_run):  # noqa: F811
    """8 clients (--max-connections 8) each drip a body byte every 0.3 s, well within the old per-chunk timeout: health
    was refused (every slot taken) and the bodies never timed out. Now health is answered from the reserve and each
    body gets a 408 once --read-timeout-s has passed since its head."""
    deadline, n = 1.5, 8
    with ServerThread(mlp_run / "model.safetensors", ServeOptions(read_timeout_s=deadline, max_connections=n)) as srv:
        socks, ended, stop = [], {}, threading.Event()
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            s.sendall(HEAD + b"Content-Length: 1000\r\n\r\n{")
            socks.append(s)
        t0 = time.perf_counter()

        def drip():
            while not stop.wait(0.3):
                for s in socks:
                    try:
                        s.sendall(b" ")
                    except OSError:
                        pass

        def read(i, s):
            ended[i] = (answer(s)[:12], time.perf_counter() - t0)

        threads = [threading.Thread(target=drip)] + [threading.Thread(target=read, args=(i, s)) for i, s in enumerate(socks)]
        for t in threads:
            t.start()
        try:
            time.sleep(0.2)
            probes = [probe(srv.port) for _ in range(4)]  # while every slot is held
            with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as extra:  # a reserve connection
                extra.sendall(HEAD + b"Content-Length: 2\r\n\r\n{}")
                refused = answer(extra)
            held_s = time.perf_counter() - t0
        finally:
            for t in threads[1:]:
                t.join(deadline + 8)
            stop.set()
            threads[0].join()
            for s in socks:
                s.close()
        assert held_s < deadline, f"the probes ran after the slow bodies were cut ({held_s:.2f} s): nothing was tested"
        assert [p[0][:12] for p in probes] == [b"HTTP/1.1 200"] * 4, probes
        assert max(p[1] for p in probes) < 0.5, probes
        assert refused.startswith(b"HTTP/1.1 503") and b"--max-connections" in refused, refused[:200]
        assert sorted(ended) == list(range(n)) and {a for a, _ in ended.values()} == {b"HTTP/1.1 408"}, ended
        times = [t for _, t in ended.values()]
        assert deadline - 0.1 <= min(times) and max(times) < deadline + 1.5, times  # a total deadline, not per chunk
        assert httpx.get(srv.url + "/v2/health/live").status_code == 200  # the slots are free again


# ------------------------------------------------------------------ F9: millions of empty arrays

def test_a_body_of_empty_arrays_is_refused_before_it_is_parsed_and_health_stays_fast(server):
    """15 MB of `[]`: parsed, it held the GIL 3-6 s (health waited as long) for a 400. Now counted first: a 413."""
    body = b'{"inputs": [{"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": ['
    body += b"[]," * (5 << 20) + b"[]]}]}"
    result = {}

    def post():
        t0 = time.perf_counter()
        r = httpx.post(f"{server.url}/v2/models/mlp/infer", content=body, timeout=60)
        result.update(status=r.status_code, error=r.json()["error"], took=time.perf_counter() - t0)

    poster = threading.Thread(target=post)
    poster.start()
    worst = 0.0
    while poster.is_alive():
        worst = max(worst, probe(server.port)[1])
        time.sleep(0.005)
    poster.join()
    assert result["status"] == 413 and "JSON values, arrays and objects" in result["error"], result
    assert "--max-batch-size 16 rows" in result["error"] and worst < 0.5, (result, worst)


def test_the_count_admits_the_largest_request_and_bounds_free_shapes(server):
    """No false refusal: 16 rows of nested data (the most a request holds) with commas and brackets in its id."""
    x = np.zeros((16, 1, 8, 8), np.float32)
    req = {"inputs": [{"name": "input", "shape": [16, 1, 8, 8], "datatype": "FP32", "data": x.tolist()}],
           "id": ",[{" * 10_000, "outputs": [{"name": server.service.served.outputs[0].name}]}
    r = httpx.post(f"{server.url}/v2/models/mlp/infer", content=json.dumps(req), timeout=30)
    assert r.status_code == 200, r.text[:300]
    assert request_items(server.service.served.inputs, 16) == server.service.max_json_items
    # A model with a free dimension past the batch one: the arrays and objects alone are counted.
    assert request_items([TensorSpec("x", "FP32", (-1, -1, 3))], 16) is None
    check_items(b"[" + b"1," * 100_000 + b"[]" * (MAX_JSON_CONTAINERS - 1) + b"]", None)  # values are cheap
    with pytest.raises(RequestError, match=r"more than 65536 JSON arrays and objects.*send tensor data flat") as e:
        check_items(b"[" + b"[]," * MAX_JSON_CONTAINERS + b"[]]", None)
    assert e.value.status == 413


# ------------------------------------------------------------------ N15: the head limit, however the head arrives

@pytest.mark.parametrize("parts", [1, 3])
def test_a_head_over_the_limit_is_a_431_in_one_write_or_several(server, parts):
    pad = b"X-Pad: " + b"a" * (100 * 1024) + b"\r\n"
    head = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n" + pad + b"\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        step = -(-len(head) // parts)
        for i in range(0, len(head), step):
            try:
                s.sendall(head[i:i + step])
            except OSError:  # already answered and closed (the rest of the head unread)
                break
            time.sleep(0.05 if parts > 1 else 0)
        got = answer(s)
    assert got.startswith(b"HTTP/1.1 431") and f"over {MAX_HEAD_BYTES} bytes".encode() in got, got[:200]
    small = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * (MAX_HEAD_BYTES - 1024) + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:  # just under the limit: served
        s.sendall(small)
        assert s.recv(4096).startswith(b"HTTP/1.1 200")


def test_requests_given_up_during_a_cold_start_never_reach_a_replica(mlp_run, monkeypatch):  # noqa: F811
    """--autoscale 0:2: one client disconnects, another's request passes --timeout-ms, both while the first replica
    starts. Both ran once it was up (answers nobody read); now neither is sent to it. A third request, sent once the
    replica is up, is (the count of batches sent to replicas is what is checked)."""
    sent = []
    real = replicas_module.Submit
    monkeypatch.setattr(replicas_module, "Submit", lambda *a: sent.append(a[0]) or real(*a))
    body = json.dumps(infer_json(np.zeros((1, 1, 8, 8), np.float32))).encode()
    opts = ServeOptions(autoscale="0:2", timeout_ms=60_000, max_delay_ms=0)
    with ServerThread(mlp_run / "model.safetensors", opts) as srv:
        pool = srv.service.executor
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:  # gives up after 0.2 s
            s.sendall(HEAD + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(0.2)
        srv.service.opts.timeout_ms = 200  # read per request: this one is held 0.2 s, then 504
        late = httpx.post(f"{srv.url}/v2/models/mlp/infer", content=body, timeout=30)
        srv.service.opts.timeout_ms = 60_000
        assert late.status_code == 504 and pool.live_count == 0, "the replica came up before the requests gave up"
        poll(lambda: pool.live_count >= 1, 60, "the first replica")
        time.sleep(0.5)
        assert sent == [], sent
        assert httpx.post(f"{srv.url}/v2/models/mlp/infer", content=body, timeout=30).status_code == 200
        assert len(sent) == 1
        text = httpx.get(srv.url + "/metrics").text
        assert re.search(r'plait_requests_total\{code="499",endpoint="infer"\} 1\.0', text), text
