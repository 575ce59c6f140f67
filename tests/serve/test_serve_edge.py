"""`plait serve model.onnx`: an exported file behind the same server, batcher and OIP endpoints."""

import asyncio

import httpx
import numpy as np
import pytest
import torch

from plait.serve.entrypoints.server import ServerThread
from plait.serve.errors import ServeError
from plait.serve.model.load import ModelRef, load_model
from plait.serve.service import ServeOptions, Service
from serve_helpers import gather_posts, infer_json, mlp_run  # noqa: F401

pytest.importorskip("onnxruntime", reason="the edge extra is not installed: pip install 'plait[edge]'")


@pytest.fixture(scope="module")
def onnx_file(mlp_run, tmp_path_factory):  # noqa: F811
    from plait.edge import export_edge

    out = tmp_path_factory.mktemp("edge-serve") / "model.onnx"
    export_edge(mlp_run, out, batch="dynamic")
    return out


def test_onnx_is_served_with_the_same_endpoints(onnx_file, mlp_run):  # noqa: F811
    eager = load_model(ModelRef(str(mlp_run))).module
    x = torch.randn(24, 1, 8, 8, generator=torch.Generator().manual_seed(3))
    with ServerThread(onnx_file, ServeOptions(max_batch_size=8, max_delay_ms=20)) as srv:
        meta = httpx.get(f"{srv.url}/v2/models/mlp").json()
        assert meta["platform"] == "onnxruntime" and meta["inputs"][0]["shape"] == [-1, 1, 8, 8]
        bodies = [infer_json(x[i:i + 3].numpy()) for i in range(0, 24, 3)]  # 8 requests of 3 rows, batched together
        answers = asyncio.run(gather_posts(f"{srv.url}/v2/models/mlp/infer", bodies))
        assert [r.status_code for r in answers] == [200] * 8
        got = np.concatenate([np.array(r.json()["outputs"][0]["data"]).reshape(3, 10) for r in answers])
        labels = np.concatenate([r.json()["outputs"][1]["data"] for r in answers])
        want = eager(x).numpy()
        assert np.abs(got - want).max() <= 1e-5 and np.array_equal(labels, want.argmax(-1))
        bad = httpx.post(f"{srv.url}/v2/models/mlp/infer", json=infer_json(np.zeros((1, 3), np.float32)))
        assert bad.status_code == 400 and "shape" in bad.json()["error"]
        assert 'plait_batch_size_count' in httpx.get(f"{srv.url}/metrics").text


def test_serving_flags_that_do_not_apply_are_refused(onnx_file):
    with pytest.raises(ServeError, match=r"--quantize applies to PyTorch weights; .*model.onnx is an exported file: "
                                         r"export it with `plait export RUN_DIR -o model.onnx --quantize int8` instead"):
        Service(str(onnx_file), ServeOptions(quantize="int8"))
    with pytest.raises(ServeError, match=r"--pp 2 splits a PyTorch model's blocks; .* \(onnxruntime\): serve it with "
                                         r"--replicas instead"):
        Service(str(onnx_file), ServeOptions(pp=2))


def test_generate_on_an_exported_language_model_says_why_and_what_to_serve():
    """issue 38 item 11: an ONNX-served GPT answered /v1/generate with 'does not generate text (it is a gpt lm')."""
    from types import SimpleNamespace

    from plait.serve.errors import RequestError

    served = SimpleNamespace(can_generate=False, is_lm=True, backend="onnxruntime", registry_name="gpt",
                             spec=SimpleNamespace(task="lm"))
    with pytest.raises(RequestError) as e:
        Service.require_generation(SimpleNamespace(served=served, name="gpt"))
    assert e.value.status == 404 and str(e.value).startswith(
        "model 'gpt' is served from an exported onnxruntime file, which runs one forward pass and has no KV cache")
    assert "serve the run directory or its model.safetensors for /v1/generate" in str(e.value)
