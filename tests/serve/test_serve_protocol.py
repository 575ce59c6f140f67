"""Open Inference Protocol: Triton's own client against a real server, metadata, and every kind of bad input."""

import json

import httpx
import numpy as np
import pytest
import torch
import tritonclient.http as triton
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.utils import InferenceServerException

from plait.serve.entrypoints.protocol import HEADER_LENGTH, decode_infer_request
from plait.serve.entrypoints.server import ServerThread
from plait.serve.service import ServeOptions
from serve_helpers import infer_json, mlp_run  # noqa: F401

LIMIT_MB = 0.01  # 10485 bytes: small, so that 413 needs only a small body
TOKEN = "s3cret"


@pytest.fixture(scope="module")
def server(mlp_run):  # noqa: F811
    with ServerThread(mlp_run / "model.safetensors", ServeOptions(max_batch_size=8, max_delay_ms=0,
                                                                   max_body_mb=LIMIT_MB)) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def reference(mlp_run):  # noqa: F811
    from plait.export import load_exported

    model, _ = load_exported(mlp_run / "model.safetensors")
    return model.eval()


@pytest.mark.parametrize("binary", [True, False])
def test_triton_client_round_trip(server, reference, binary):
    client = triton.InferenceServerClient(url=f"127.0.0.1:{server.port}")
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("mlp")
    meta = client.get_model_metadata("mlp")
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 1, 8, 8]}]
    assert meta["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]},
                               {"name": "label", "datatype": "INT64", "shape": [-1]}]
    assert client.get_model_repository_index() == [{"name": "mlp", "version": "1", "state": "READY"}]
    x = np.random.default_rng(0).standard_normal((3, 1, 8, 8)).astype(np.float32)
    inp = triton.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    outputs = [triton.InferRequestedOutput("logits", binary_data=binary), triton.InferRequestedOutput("label", binary_data=binary)]
    for _ in range(3):  # keep-alive: the same connection answers again
        result = client.infer("mlp", [inp], outputs=outputs, request_id="r1")
        logits = result.as_numpy("logits")
        assert logits.dtype == np.float32 and logits.shape == (3, 10)
        torch.testing.assert_close(torch.from_numpy(logits.copy()), reference(torch.from_numpy(x)), rtol=0, atol=1e-5)
        np.testing.assert_array_equal(result.as_numpy("label"), logits.argmax(-1))
        assert result.get_response()["id"] == "r1"
    # no outputs named: the client asks for all of them in binary
    default = client.infer("mlp", [inp])
    assert [o["name"] for o in default.get_response()["outputs"]] == ["logits", "label"]
    np.testing.assert_array_equal(default.as_numpy("logits"), logits)
    with pytest.raises(InferenceServerException, match="unknown model 'nope'; this server serves: mlp"):
        client.infer("nope", [inp])
    client.close()


def test_metadata_endpoints(http):
    assert http.get("/v2/health/live").json() == {"live": True}
    assert http.get("/v2/health/ready").status_code == 200
    assert http.get("/v2/models").json() == {"models": [{"name": "mlp", "version": "1", "state": "READY"}]}
    assert http.post("/v2/repository/index").json() == [{"name": "mlp", "version": "1", "state": "READY"}]
    meta = http.get("/v2/models/mlp").json()
    assert meta["name"] == "mlp" and meta["platform"] == "pytorch" and meta["parameters"]["max_batch_size"] == 8
    assert http.get("/v2/models/mlp/versions/1").json() == meta
    assert http.get("/v2/models/mlp/ready").json() == {"name": "mlp", "ready": True}
    assert http.get("/v2/models/mlp/config").json()["input"] == [{"name": "input", "data_type": "TYPE_FP32", "dims": [1, 8, 8]}]
    schema = http.get("/openapi.json").json()
    infer = schema["paths"]["/v2/models/{model}/infer"]["post"]
    assert infer["requestBody"]["content"]["application/json"]["schema"]["required"] == ["inputs"]
    assert "/v1/generate" in schema["paths"] and "/v2/repository/index" in schema["paths"]


def test_binary_request_by_hand_without_content_type(http, reference):
    """The framing tritonclient uses: JSON header, raw little-endian bytes, no Content-Type; binary answer back."""
    x = np.arange(2 * 64, dtype="<f4").reshape(2, 1, 8, 8) / 100
    head = json.dumps({"inputs": [{"name": "input", "shape": [2, 1, 8, 8], "datatype": "FP32",
                                   "parameters": {"binary_data_size": x.nbytes}}],
                       "outputs": [{"name": "logits", "parameters": {"binary_data": True}}]}).encode()
    r = http.post("/v2/models/mlp/infer", content=head + x.tobytes(), headers={HEADER_LENGTH: str(len(head))})
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    n = int(r.headers[HEADER_LENGTH.lower()])
    out = json.loads(r.content[:n])["outputs"]
    assert out == [{"name": "logits", "datatype": "FP32", "shape": [2, 10], "parameters": {"binary_data_size": 80}}]
    logits = np.frombuffer(r.content[n:], dtype="<f4").reshape(2, 10)
    torch.testing.assert_close(torch.from_numpy(logits.copy()), reference(torch.from_numpy(x)), rtol=0, atol=1e-5)


def _tensor(**kw):
    base = {"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": [0.5] * 64}
    base.update(kw)
    return {"inputs": [base]}


@pytest.mark.parametrize("body, status, message", [
    (_tensor(name="x"), 400, "unknown input 'x'; model 'mlp' takes: input (FP32 [-1, 1, 8, 8])"),
    (_tensor(shape=[1, 64], data=[0.5] * 64), 400,
     "input 'input' has shape [1, 64] but model 'mlp' expects [-1, 1, 8, 8] (-1: any size)"),
    (_tensor(datatype="FP64"), 400, "input 'input' has datatype FP64 but model 'mlp' expects FP32"),
    (_tensor(datatype="BYTES"), 400, 'input \'input\': datatype "BYTES" is not supported; use one of BOOL'),
    (_tensor(data=[0.5] * 3), 400, "input 'input': data has 3 values but shape [1, 1, 8, 8] needs 64"),
    (_tensor(data=["a"] * 64), 400, "input 'input': data must hold numbers for datatype FP32, found \"a\""),
    (_tensor(shape=[9, 1, 8, 8], data=[0.5] * 576), 400,
     "the request has batch size 9 but max_batch_size is 8; split it into smaller requests"),
    (_tensor(shape=[0, 1, 8, 8], data=[]), 400, "input 'input' has shape [0, 1, 8, 8]: every dimension must be at least 1"),
    (_tensor(shape=[1, -1, 8, 8]), 400, "input 'input': shape must be a list of non-negative integers"),
    ({"inputs": []}, 400, "request must have 'inputs': a non-empty list of tensors"),
    ([1, 2], 400, "request body must be a JSON object with 'inputs', got list"),
    ({**_tensor(), "outputs": [{"name": "probs"}]}, 400, "unknown output 'probs'; model 'mlp' has: logits, label"),
    ({"inputs": [_tensor()["inputs"][0], _tensor()["inputs"][0]]}, 400, "input 'input' is given twice"),
    (_tensor(parameters={"binary_data_size": 256}), 400,
     "input 'input': the body holds 0 bytes of tensor data after the JSON header, 256 are declared"),
])
def test_bad_json_requests_are_400_with_the_problem_named(http, body, status, message):
    r = http.post("/v2/models/mlp/infer", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"].startswith(message), r.json()["error"]
    assert http.get("/v2/health/live").status_code == 200


def test_malformed_body_size_and_routes(http):
    r = http.post("/v2/models/mlp/infer", content=b'{"inputs": [')
    assert r.status_code == 400 and r.json()["error"].startswith("request body is not valid JSON: Expecting value")
    r = http.post("/v2/models/mlp/infer", content=b"\xff\xfe")
    assert r.status_code == 400 and r.json()["error"].startswith("request body is not valid JSON")
    big = json.dumps(_tensor(shape=[16, 1, 8, 8], data=[0.123456789] * 1024)).encode()
    assert len(big) > LIMIT_MB * 2**20
    r = http.post("/v2/models/mlp/infer", content=big)
    assert r.status_code == 413
    assert r.json()["error"] == f"request body is {len(big)} bytes; the limit is 10485 (--max-body-mb)"

    def chunks():  # no Content-Length: the limit holds while streaming
        yield big[:5000]
        yield big[5000:]

    r = http.post("/v2/models/mlp/infer", content=chunks())
    assert r.status_code == 413 and r.json()["error"] == "request body is over the limit of 10485 bytes (--max-body-mb)"
    head = b'{"inputs": []}'
    r = http.post("/v2/models/mlp/infer", content=head, headers={HEADER_LENGTH: "many"})
    assert r.status_code == 400 and r.json()["error"] == f"{HEADER_LENGTH} = 'many' is not an integer"
    r = http.post("/v2/models/mlp/infer", content=head, headers={HEADER_LENGTH: "99"})
    assert r.status_code == 400 and r.json()["error"].startswith(f"{HEADER_LENGTH} = 99 but the body has 14 bytes")
    for path in ("/v2/models/nope/infer", "/v2/models/nope", "/v2/models/nope/ready"):
        r = http.post(path, json=_tensor()) if path.endswith("infer") else http.get(path)
        assert r.status_code == 404 and r.json()["error"] == "unknown model 'nope'; this server serves: mlp"
    r = http.get("/v2/models/mlp/versions/7")
    assert r.status_code == 404 and r.json()["error"] == "model 'mlp' has no version '7'; it has version 1"
    r = http.get("/v3/whatever")
    assert r.status_code == 404 and r.json()["error"] == "no such endpoint: GET /v3/whatever"
    r = http.post("/v1/generate", json={"prompt": "x"})
    assert r.status_code == 404
    assert r.json()["error"].startswith("model 'mlp' does not generate text (it is a mlp classification model)")


def test_decoder_keeps_tensors_in_order():
    a, b = np.arange(4, dtype="<i8"), np.ones((2, 2), dtype="<f2")
    head = json.dumps({"inputs": [
        {"name": "a", "shape": [4], "datatype": "INT64", "parameters": {"binary_data_size": 32}},
        {"name": "j", "shape": [2], "datatype": "BOOL", "data": [True, False]},
        {"name": "b", "shape": [2, 2], "datatype": "FP16", "parameters": {"binary_data_size": 8}}]}).encode()
    req = decode_infer_request(head + a.tobytes() + b.tobytes(), str(len(head)))
    np.testing.assert_array_equal(req.inputs["a"], a)
    np.testing.assert_array_equal(req.inputs["b"], b)
    assert req.inputs["j"].tolist() == [True, False] and req.datatypes == {"a": "INT64", "j": "BOOL", "b": "FP16"}


json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=5),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                           max_leaves=20)
tensors = st.fixed_dictionaries(
    {"name": st.sampled_from(["input", "x", ""]),
     "shape": st.lists(st.integers(-1, 9), max_size=5) | json_values,
     "datatype": st.sampled_from(["FP32", "FP64", "INT64", "BYTES", "BF16", "fp32"]) | json_values},
    optional={"data": st.lists(st.floats(width=32) | st.integers(-5, 5) | st.booleans(), max_size=80) | json_values,
              "parameters": st.fixed_dictionaries({"binary_data_size": st.integers(-1, 300)}) | json_values})
requests = st.fixed_dictionaries({"inputs": st.lists(tensors, max_size=2) | json_values},
                                 optional={"outputs": st.lists(st.fixed_dictionaries({"name": st.sampled_from(
                                     ["logits", "label", "z"])}, optional={"parameters": json_values}), max_size=2) | json_values,
                                           "parameters": json_values, "id": json_values})


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=requests | json_values, raw=st.binary(max_size=300), header=st.none() | st.integers(-5, 400))
def test_property_any_request_gets_a_protocol_answer(http, body, raw, header):
    """Whatever the body (schema-shaped or not, JSON or binary framing), the answer is 200 or a 4xx with an error."""
    head = json.dumps(body, allow_nan=True).encode()
    headers = {} if header is None else {HEADER_LENGTH: str(header if header != 0 else len(head))}
    r = http.post("/v2/models/mlp/infer", content=head + raw if header is not None else head, headers=headers)
    assert r.status_code in (200, 400, 413), (r.status_code, r.text)
    if r.status_code != 200:
        assert isinstance(r.json()["error"], str) and r.json()["error"]


def test_server_survived_everything(http):
    assert http.get("/v2/health/ready").status_code == 200
    r = http.post("/v2/models/mlp/infer", json=_tensor())
    assert r.status_code == 200
    assert "plait_requests_total" in http.get("/metrics").text


def test_bearer_token(mlp_run):  # noqa: F811
    with ServerThread(mlp_run / "model.safetensors", ServeOptions(token=TOKEN, max_delay_ms=0)) as srv:
        with httpx.Client(base_url=srv.url) as http:
            r = http.get("/v2/models")
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"] == "missing or wrong bearer token: send 'Authorization: Bearer <token>'"
            assert http.get("/v2/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert http.post("/v2/models/mlp/infer", json=_tensor()).status_code == 401
            assert http.get("/metrics").status_code == 401
            assert http.get("/v2/health/live").status_code == 200 and http.get("/v2/health/ready").status_code == 200
            good = {"Authorization": f"Bearer {TOKEN}"}
            assert http.post("/v2/models/mlp/infer", json=_tensor(), headers=good).status_code == 200
        client = triton.InferenceServerClient(url=f"127.0.0.1:{srv.port}")
        x = np.zeros((1, 1, 8, 8), dtype=np.float32)
        inp = triton.InferInput("input", [1, 1, 8, 8], "FP32")
        inp.set_data_from_numpy(x)
        with pytest.raises(InferenceServerException, match="missing or wrong bearer token"):
            client.infer("mlp", [inp])
        assert client.infer("mlp", [inp], headers=good).as_numpy("logits").shape == (1, 10)
        client.close()


def test_infer_json_helper_matches_protocol(http):
    r = http.post("/v2/models/mlp/infer", json=infer_json(np.zeros((2, 1, 8, 8), dtype=np.float32)))
    assert r.status_code == 200
    assert [o["shape"] for o in r.json()["outputs"]] == [[2, 10], [2]]
