"""Hostile files and requests against `plait serve` (docs/security.md): each row of the audit with its own payload,
and hypothesis-driven bodies for the OIP decoder and /v1/generate. In-process ASGI unless a socket is the point."""

import asyncio
import contextlib
import json
import resource
import socket
import time
import tracemalloc

import httpx
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from starlette.testclient import TestClient

import plait.serve.entrypoints.app as app_module
from plait.cli import build_parser, main
from plait.errors import CheckpointError
from plait.export import load_exported
from plait.serve.cli import TOKEN_ENV, serve_token
from plait.serve.entrypoints.app import create_app, endpoint_of
from plait.serve.entrypoints.protocol import HEADER_LENGTH, encode_error
from plait.serve.entrypoints.server import ServerThread
from plait.serve.errors import RequestError
from plait.serve.executor import generate as kvcache
from plait.serve.executor.generate import GenRow, RowFailed, generate
from plait.serve.service import ServeOptions, Service
from serve_helpers import gpt_run, mlp_run  # noqa: F401

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def strict_json(content: bytes):
    """What a strict JSON parser accepts: no NaN, Infinity or -Infinity."""
    def refuse(token):
        raise ValueError(f"{token} in a response body")
    return json.loads(content, parse_constant=refuse)


@contextlib.contextmanager
def app_client(path, **opts):
    service = Service(str(path), ServeOptions(**opts))
    with TestClient(create_app(service), raise_server_exceptions=False) as client:
        yield client, service


@pytest.fixture(scope="module")
def mlp(mlp_run):  # noqa: F811
    with app_client(mlp_run / "model.safetensors", max_delay_ms=0, max_batch_size=8, token=TOKEN) as (client, _):
        client.headers.update(AUTH)
        yield client


@pytest.fixture(scope="module")
def gpt(gpt_run):  # noqa: F811
    with app_client(gpt_run / "model.safetensors", max_delay_ms=0, max_new_tokens=4, max_prompt_chars=5000) as (client, _):
        yield client


def tensor(**kw):
    base = {"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": [0.5] * 64}
    return {"inputs": [base | kw]}


# ------------------------------------------------------------------ row 2 and 16: exported files

def _rewrite(src, dst, meta_update=None, tensors_update=None):
    with safe_open(str(src), framework="pt") as f:
        meta = dict(f.metadata())
    tensors = load_file(str(src))
    meta.update(meta_update or {})
    tensors.update(tensors_update or {})
    save_file(tensors, str(dst), metadata=meta)
    return dst


def test_a_factory_named_in_an_exported_file_runs_only_with_trust(mlp_run, tmp_path, capsys):  # noqa: F811
    """Row 2: `plait serve model.safetensors` imported and called the file's factory (subprocess:run worked)."""
    marker = tmp_path / "pwned"
    model = json.loads(safe_open(str(mlp_run / "model.safetensors"), framework="pt").metadata()["plait.model"])
    model |= {"factory": "subprocess:run", "options": {"args": ["touch", str(marker)]}}
    evil = _rewrite(mlp_run / "model.safetensors", tmp_path / "evil.safetensors", {"plait.model": json.dumps(model)})
    assert main(["serve", str(evil), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "names model.factory = 'subprocess:run'" in err and "--trust-factory" in err and len(err.splitlines()) == 1
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="returned CompletedProcess, not an nn.Module"):
        load_exported(evil, trust_factory=True)  # trusted: the code runs (here: harmlessly), then a clean error
    assert marker.exists()


@pytest.mark.parametrize("damage, message", [
    ("garbage", "is not a readable safetensors file"),
    ("nan", "holds NaN or Inf; refusing to serve a model with broken weights"),
    ("dtype", "has dtype F64, the model's is float32"),
    ("shape", "has shape [3], the model's is"),
    ("unknown-key", "has unknown keys ['colour']"),
    ("bad-json", "metadata plait.spec is not valid JSON"),
])
def test_broken_exports_are_one_line_errors(mlp_run, tmp_path, capsys, damage, message):  # noqa: F811
    """Row 16: a broken file printed a traceback; wrong dtypes and NaN weights were served silently."""
    src, dst = mlp_run / "model.safetensors", tmp_path / "broken.safetensors"
    tensors = load_file(str(src))
    name = next(iter(tensors))
    if damage == "garbage":
        dst.write_bytes(b"\xff" * 7 + src.read_bytes()[7:200])
    elif damage == "nan":
        _rewrite(src, dst, tensors_update={name: torch.full_like(tensors[name], float("nan"))})
    elif damage == "dtype":
        _rewrite(src, dst, tensors_update={name: tensors[name].double()})
    elif damage == "shape":
        _rewrite(src, dst, tensors_update={name: torch.zeros(3)})
    elif damage == "unknown-key":
        model = json.loads(safe_open(str(src), framework="pt").metadata()["plait.model"]) | {"colour": "red"}
        _rewrite(src, dst, {"plait.model": json.dumps(model)})
    else:
        _rewrite(src, dst, {"plait.spec": "{not json"})
    assert main(["serve", str(dst), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------ row 3: metric labels

def test_unknown_paths_share_one_metric_label(mlp):
    """Row 3: each unknown path (even answered 401) created a label: 20,000 requests, 154 MB."""
    for i in range(300):
        assert mlp.get(f"/nope/{i}", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert mlp.post(f"/v2/models/mlp/x{i}").status_code in (404, 405)
    text = mlp.get("/metrics").text
    labels = {line.split('endpoint="')[1].split('"')[0] for line in text.splitlines() if 'endpoint="' in line}
    assert labels <= {"infer", "generate", "health", "metadata", "metrics", "docs", "other"}, labels
    assert 'plait_requests_total{code="401",endpoint="other"} 300.0' in text
    assert len(text) < 20_000
    assert endpoint_of("/v2/models/mlp/versions/1/infer") == "infer" and endpoint_of("/v2/models/a/b/c/d") == "other"


# ------------------------------------------------------------------ row 5: prompt limits

def test_a_huge_prompt_is_refused_before_it_is_decoded(gpt):
    """Row 5: six 15 MB prompts took RSS from 333 MB to 1.8 GB (copied into int lists before the cut)."""
    body = b'{"prompt": "' + b"a" * 15_000_000 + b'"}'
    r = gpt.post("/v1/generate", content=body)
    assert r.status_code == 413 and "--max-prompt-chars" in r.json()["error"]
    r = gpt.post("/v1/generate", json={"prompt": "b" * 5001})
    assert r.status_code == 413 and r.json()["error"] == "'prompt' has 5001 characters; the limit is 5000 (--max-prompt-chars)"


def test_only_the_context_of_a_long_prompt_is_tokenized(gpt_run):  # noqa: F811
    long = "import os\n" * 300  # 3000 characters, the context is 32
    with app_client(gpt_run / "model.safetensors", max_delay_ms=0, max_prompt_chars=4_000_000) as (client, service):
        whole = client.post("/v1/generate", json={"prompt": long, "max_new_tokens": 6, "temperature": 0}).json()
        tail = client.post("/v1/generate", json={"prompt": long[-32:], "max_new_tokens": 6, "temperature": 0}).json()
        assert whole["tokens"] == tail["tokens"] and whole["prompt_tokens"] == 3000
        big = json.dumps({"prompt": "x" * 3_000_000, "max_new_tokens": 1, "temperature": 0}).encode()
        tracemalloc.start()
        try:
            r = client.post("/v1/generate", content=big)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert r.status_code == 200 and r.json()["prompt_tokens"] == 3_000_000
        # body + its text, a few copies in the transport: no per-token Python objects (those were ~100 MB here)
        assert peak < 40e6, peak


# ------------------------------------------------------------------ row 8: sampling parameters, isolation

def test_tiny_temperature_is_a_400(gpt):
    r = gpt.post("/v1/generate", json={"prompt": "a", "temperature": 1e-300})
    assert r.status_code == 400 and r.json()["error"] == "'temperature' must be 0 (greedy) or at least 0.01, got 1e-300"


def test_one_bad_row_fails_alone(gpt_run):  # noqa: F811
    """Row 8: every request batched with temperature 1e-300 got a 500. Rows fail alone, in the loop and in the service."""
    model = load_exported(gpt_run / "model.safetensors")[0].eval()
    good, bad = GenRow([1, 2, 3], 5, 0.0), GenRow([4, 5], 5, 1e-300, None, 1)
    out = generate(model, [bad, good])
    assert isinstance(out[0], RowFailed) and out[1] == generate(model, [good])[0]

    async def batched(scheduler: str):
        service = Service(str(gpt_run / "model.safetensors"), ServeOptions(max_delay_ms=300, max_batch_size=2,
                                                                           scheduler=scheduler))
        await service.start()
        try:
            arrived = time.perf_counter()
            return await asyncio.gather(service.generate(bad, arrived), service.generate(good, arrived),
                                        return_exceptions=True), service.metrics.render().decode()
        finally:
            await service.stop()

    (failed, tokens), metrics = asyncio.run(batched("static"))
    assert isinstance(failed, RequestError) and failed.status == 400 and "sampling parameters" in str(failed)
    assert tokens == out[1] and "plait_batch_size_sum 2.0" in metrics  # they shared one batch
    (failed, tokens), metrics = asyncio.run(batched("continuous"))  # the engine: one sequence fails, the other goes on
    assert isinstance(failed, RequestError) and failed.status == 400 and "sampling parameters" in str(failed)
    assert tokens == out[1] and "plait_sequences_running 0.0" in metrics


# ------------------------------------------------------------------ row 9: bodies decoded off the loop

def test_large_bodies_are_decoded_off_the_event_loop(mlp_run, monkeypatch):  # noqa: F811
    """Row 9: three 15 MB bodies stalled /v2/health/live for 3-4 s."""
    threads = []
    real = app_module.decode_infer_request

    def spy(body, *args):
        import threading

        threads.append(threading.current_thread().name)
        return real(body, *args)

    monkeypatch.setattr(app_module, "decode_infer_request", spy)
    big = json.dumps(tensor(data=[0.123456] * 600_000)).encode()  # ~5 MB; more values than a request holds: 413

    async def main_():
        service = Service(str(mlp_run / "model.safetensors"), ServeOptions(max_delay_ms=0))
        await service.start()
        try:
            transport = httpx.ASGITransport(app=create_app(service))
            async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
                posts = [asyncio.ensure_future(c.post("/v2/models/mlp/infer", content=big)) for _ in range(3)]
                worst = 0.0
                while not all(p.done() for p in posts):
                    t0 = time.perf_counter()
                    assert (await c.get("/v2/health/live")).status_code == 200
                    worst = max(worst, time.perf_counter() - t0)
                    await asyncio.sleep(0.005)
                small = await c.post("/v2/models/mlp/infer", json=tensor())
                return [p.result().status_code for p in posts], worst, small.status_code
        finally:
            await service.stop()

    codes, worst, small = asyncio.run(main_())
    assert codes == [413] * 3 and small == 200  # counted (protocol.check_items) on the codec thread, never parsed
    assert threads.count("MainThread") == 1 and len(threads) == 4  # the small body inline, the large ones on threads
    assert all(t.startswith("plait-codec") for t in threads if t != "MainThread")
    assert worst < 2.0, worst


# ------------------------------------------------------------------ row 10: a client that leaves stops its work

def test_a_client_that_disconnects_stops_its_generation(gpt_run, monkeypatch):  # noqa: F811
    calls = []
    real = kvcache.sample_row
    monkeypatch.setattr(kvcache, "sample_row", lambda *a: calls.append(1) or real(*a))
    body = json.dumps({"prompt": "def ", "max_new_tokens": 1000, "temperature": 0}).encode()

    async def main_():
        service = Service(str(gpt_run / "model.safetensors"), ServeOptions(max_delay_ms=0))
        await service.start()
        gone, sent = asyncio.Event(), []

        async def receive():
            if not sent:
                sent.append(1)
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        messages = []

        async def send(message):
            messages.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/generate", "raw_path": b"/v1/generate", "query_string": b"",
                 "headers": [(b"content-type", b"application/json")], "http_version": "1.1", "scheme": "http",
                 "server": ("t", 80), "client": ("c", 1), "root_path": ""}
        try:
            task = asyncio.ensure_future(create_app(service)(scope, receive, send))
            while len(calls) < 5:
                await asyncio.sleep(0.005)
            gone.set()
            await asyncio.wait_for(task, 30)
            at_exit = len(calls)
            await asyncio.sleep(0.3)
            return at_exit, len(calls), messages[0]["status"]
        finally:
            await service.stop()

    at_exit, later, status = asyncio.run(main_())
    assert status == 499 and later <= at_exit + 2 and later < 200, (at_exit, later)  # a step in flight may finish


# ------------------------------------------------------------------ row 11: slow heads, too many connections

def test_half_sent_heads_time_out_and_connections_are_capped(mlp_run):  # noqa: F811
    opts = ServeOptions(max_delay_ms=0, read_timeout_s=0.5, max_connections=8)
    with ServerThread(mlp_run / "model.safetensors", opts) as srv:
        socks = []
        for _ in range(12):
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")  # never finished
            s.settimeout(5)
            socks.append(s)
        t0 = time.perf_counter()
        closed_at = []
        for s in socks:
            try:
                assert s.recv(1024) == b""
            except ConnectionResetError:
                pass
            closed_at.append(time.perf_counter() - t0)
            s.close()
        assert max(closed_at) < 3.0, closed_at  # 45 s and more before
        body = socket.create_connection(("127.0.0.1", srv.port))
        body.sendall(b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        body.settimeout(5)
        answer = b""
        while b"read-timeout" not in answer and (chunk := body.recv(4096)):
            answer += chunk
        body.close()
        assert answer.startswith(b"HTTP/1.1 408") and b"--read-timeout-s" in answer
        assert httpx.get(srv.url + "/v2/health/live").status_code == 200


# ------------------------------------------------------------------ rows 13 and 14: 400, never 500; valid JSON

DEEP = b"[" * 1000 + b"]" * 1000


@pytest.mark.parametrize("body, message", [
    (tensor(data=[True] * 64), "data must hold numbers for datatype FP32, found true"),
    (b'{"inputs": [{"name": "input", "shape": [1], "datatype": "FP32", "data": [' + b"7" * 4301 + b"]}]}",
     "request body is not valid JSON: Exceeds the limit (4300 digits)"),
    (DEEP, "request body is nested too deeply to be parsed"),
    (b'{"inputs": [{"name": "input", "datatype": "FP32", "data": [], "shape": [0, ' + str(10**30).encode() + b"]}]}",
     "is too large"),
    (tensor(shape=[1] * 65, data=[0.5]), "shape has 65 dimensions; at most 32 are supported"),
    (b'{"inputs": [{"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": [NaN' + b", 0" * 63 + b"]}]}",
     "request body is not valid JSON: NaN is not a JSON value"),
    (tensor(data=[1e39] + [0.5] * 63), "holds NaN or Inf (or a value too large for FP32)"),
])
def test_malformed_infer_bodies_are_400(mlp, body, message):
    r = mlp.post("/v2/models/mlp/infer", content=body if isinstance(body, bytes) else json.dumps(body).encode())
    assert r.status_code == 400 and message in r.json()["error"], r.text


def test_malformed_generate_bodies_are_400(gpt):
    r = gpt.post("/v1/generate", content=b'{"prompt": "a\\ud800b"}')
    assert r.status_code == 400 and "lone UTF-16 surrogate" in r.json()["error"]
    r = gpt.post("/v1/generate", content=b'{"prompt": ' + DEEP + b"}")
    assert r.status_code == 400 and r.json()["error"] == "request body is nested too deeply to be parsed"
    r = gpt.post("/v1/generate", content=b'{"prompt": "a", "temperature": NaN}')
    assert r.status_code == 400


def test_both_infer_paths_answer_an_error_with_the_same_bytes(mlp, gpt):
    """The middleware's fast path (/v2/models/mlp/infer) and the framework's route (/versions/1/infer) share
    protocol.encode_error: same status, headers and body, byte for byte."""
    for body in (b"[" * 1000 + b"]" * 1000, json.dumps(tensor(shape=[1, 1, 8, 7])).encode()):
        fast = mlp.post("/v2/models/mlp/infer", content=body)
        routed = mlp.post("/v2/models/mlp/versions/1/infer", content=body)
        assert fast.status_code == routed.status_code == 400
        assert fast.content == routed.content and fast.headers["content-type"] == routed.headers["content-type"]
        assert fast.headers["content-length"] == routed.headers["content-length"] == str(len(fast.content))
    assert fast.content == (b'{"error": "input \'input\': data has 64 values but shape [1, 1, 8, 7] needs 56"}')
    assert encode_error(RequestError(503, "busy")) == (503, b'{"error": "busy"}', {"content-type": "application/json",
                                                                                    "retry-after": "1"})
    assert encode_error(KeyError("x")) == (500, b'{"error": "internal error: KeyError: \'x\'"}',
                                           {"content-type": "application/json"})
    # A message that quotes a client's lone surrogate is escaped (it was a bare 500: it cannot be written as UTF-8).
    r = gpt.post("/v1/generate", content=b'{"prompt": "a", "model": "\\ud800"}')
    assert r.status_code == 404 and r.content == b'{"error": "unknown model \'\\ud800\'; this server serves: gpt"}'


def test_nan_inputs_and_outputs(mlp):
    """Row 14: NaN/Inf inputs got 200 with a bare NaN in the body. Inputs are refused; a non-finite output is a 400."""
    x = np.zeros((1, 1, 8, 8), dtype="<f4")
    x[0, 0, 0, 0] = np.nan
    head = json.dumps({"inputs": [{"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32",
                                   "parameters": {"binary_data_size": x.nbytes}}]}).encode()
    r = mlp.post("/v2/models/mlp/infer", content=head + x.tobytes(), headers={HEADER_LENGTH: str(len(head))})
    assert r.status_code == 400 and "holds NaN or Inf" in strict_json(r.content)["error"]
    huge = tensor(data=[3.0e38] * 64)  # finite inputs whose logits overflow
    r = mlp.post("/v2/models/mlp/infer", json=huge)
    body = strict_json(r.content)
    assert r.status_code == 200 or (r.status_code == 400 and "binary data" in body["error"])
    r = mlp.post("/v2/models/mlp/infer", json=huge | {"parameters": {"binary_data_output": True}})
    assert r.status_code == 200  # binary outputs carry any float


# ------------------------------------------------------------------ row 15: the token off the command line

def test_token_from_a_file_or_the_environment(tmp_path, monkeypatch, capsys):
    parse = lambda *args: build_parser().parse_args(["serve", "run", *args])
    f = tmp_path / "token"
    f.write_text("# the token\n  s3cret  \n")
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert serve_token(parse("--token-file", str(f))) == "s3cret"
    assert serve_token(parse()) is None
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert serve_token(parse()) == "from-env"
    assert serve_token(parse("--token", "cli")) == "cli" and "visible to other users" in capsys.readouterr().err
    f.write_text("# nothing\n")
    with pytest.raises(Exception, match="holds no token"):
        serve_token(parse("--token-file", str(f)))
    f.write_text("  # a comment line\nabc#def\n")  # issue 37 N7: '#' inside a token is the token's, not a comment
    assert serve_token(parse("--token-file", str(f))) == "abc#def"
    from plait.federated.wire import parse_tokens

    assert parse_tokens("# clients\n1 tok#1\nshared#x\n") == {1: "tok#1", "*": "shared#x"}
    from plait.serve.cli import exposure_warning  # issue 37 N15: beyond loopback with no token, say so

    assert exposure_warning("0.0.0.0", None).startswith("warning: --host 0.0.0.0 listens beyond this machine with no "
                                                        "token: anyone who reaches the port can use the model")
    assert exposure_warning("gpu-box.example", "") is not None
    assert all(exposure_warning(h, None) is None for h in ("127.0.0.1", "::1", "localhost"))
    assert exposure_warning("0.0.0.0", "s3cret") is None


# ------------------------------------------------------------------ fuzz: any body gets a protocol answer

scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=5)
           | st.sampled_from([10**400 // 10**300, 1e308, -0.0]))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=20)
tensors_ = st.fixed_dictionaries(
    {"name": st.sampled_from(["input", "x", "", "\ud800"]),
     "shape": st.lists(st.integers(-1, 9) | st.sampled_from([2**31, 10**30]), max_size=70) | json_values,
     "datatype": st.sampled_from(["FP32", "FP16", "INT64", "BOOL", "BYTES", "fp32"]) | json_values},
    optional={"data": st.lists(st.floats(width=32) | st.integers(-5, 5) | st.booleans(), max_size=80) | json_values,
              "parameters": st.fixed_dictionaries({"binary_data_size": st.integers(-1, 300)}) | json_values})
infer_bodies = st.fixed_dictionaries({"inputs": st.lists(tensors_, max_size=2) | json_values},
                                     optional={"outputs": json_values, "parameters": json_values, "id": json_values})
raw_bodies = st.one_of(st.integers(1, 3000).map(lambda d: b"[" * d + b"]" * d), st.binary(max_size=200),
                       st.just(b'{"inputs": [{"name": "input", "data": [' + b"1" * 5000 + b"]}]}"))


def _assert_protocol_answer(r: httpx.Response, allowed: set[int]) -> None:
    assert r.status_code in allowed, (r.status_code, r.text[:300])
    if r.headers.get("content-type", "").startswith("application/json"):
        body = strict_json(r.content)
        if r.status_code != 200:
            assert isinstance(body["error"], str) and body["error"]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=infer_bodies | json_values, raw=raw_bodies, binary=st.binary(max_size=300), header=st.none() | st.integers(-5, 400),
       use_raw=st.booleans())
def test_fuzz_oip_decoder(mlp, body, raw, binary, header, use_raw):
    head = raw if use_raw else json.dumps(body, allow_nan=True).encode()
    headers = {} if header is None else {HEADER_LENGTH: str(header if header != 0 else len(head))}
    r = mlp.post("/v2/models/mlp/infer", content=head + binary if header is not None else head, headers=headers)
    _assert_protocol_answer(r, {200, 400, 413})


prompts = (st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=40)
           | st.sampled_from(["", "\ud800", "x" * 5001]))
gen_bodies = st.fixed_dictionaries({}, optional={
    "prompt": prompts | json_values, "max_new_tokens": st.integers(-2, 6) | json_values,
    "temperature": st.floats() | st.sampled_from([0, 1e-300, 0.01, 100, 101]) | json_values,
    "top_k": st.integers(-1, 2**40) | json_values, "seed": st.integers(-1, 2**64) | json_values,
    "stream": st.booleans() | json_values, "model": st.sampled_from(["gpt", "nope"]) | json_values,
    "extra": json_values})


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=gen_bodies | json_values, raw=raw_bodies, use_raw=st.booleans())
def test_fuzz_generate(gpt, body, raw, use_raw):
    content = raw if use_raw else json.dumps(body, allow_nan=True).encode()
    r = gpt.post("/v1/generate", content=content)
    _assert_protocol_answer(r, {200, 400, 404, 413})
    if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
        assert "event: done" in r.text or "event: error" in r.text


def test_fuzzing_kept_memory_bounded(mlp, gpt):
    """After the fuzz tests (same module): the servers still answer, and the process did not balloon."""
    assert mlp.get("/v2/health/ready").status_code == 200 and gpt.get("/v2/health/ready").status_code == 200
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 3 * 1024 * 1024  # KiB: under 3 GiB
