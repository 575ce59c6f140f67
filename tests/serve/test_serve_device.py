"""--device auto|cpu|cuda: how the flag resolves (with a fake CUDA check), its errors, and the whole path with --device cpu.

No GPU here: the CUDA path is checked up to the point where it would touch one (which device each
executor is given, which GPU each process takes); everything that runs, runs with --device cpu.
"""

import os
import re
import signal
import subprocess
import sys

import httpx
import numpy as np
import pytest
import torch

import plait.serve.service as service_module
from plait.cli import main
from plait.data.tokenizer import CharTokenizer
from plait.export import load_exported
from plait.serve.entrypoints.server import ServerThread
from plait.serve.errors import ServeError
from plait.serve.executor.generate import GenRow, generate
from plait.serve.executor.runner import Runner
from plait.serve.model.device import serve_device, torch_device
from plait.serve.model.load import ModelRef, load_model
from plait.serve.service import ServeOptions, Service
from serve_helpers import gpt_run, kill_tree, mlp_run  # noqa: F401

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
NO_CUDA = "--device cuda but CUDA is not available here; pass --device auto or --device cpu"
CUDA_QUANTIZE = "--quantize int8 runs on CPU only; drop --quantize or pass --device cpu instead of --device cuda"


def _never() -> bool:
    raise AssertionError("the CUDA check was consulted")


def test_device_resolves_with_a_fake_cuda_check():
    yes, no = (lambda: True), (lambda: False)
    assert serve_device("auto", None, yes) == "cuda" and serve_device("auto", None, no) == "cpu"
    assert serve_device("cuda", None, yes) == "cuda"
    assert serve_device("cpu", None, _never) == "cpu"  # cpu never asks
    assert serve_device("auto", "int8", _never) == "cpu"  # quantized models run on CPU: auto picks it
    with pytest.raises(ServeError, match=re.escape(NO_CUDA)):
        serve_device("cuda", None, no)
    with pytest.raises(ServeError, match=re.escape(CUDA_QUANTIZE)):
        serve_device("cuda", "int8", yes)
    with pytest.raises(ServeError, match=re.escape("--device 'tpu' is not one of: auto, cpu, cuda")):
        serve_device("tpu")
    with pytest.raises(ServeError, match=re.escape(CUDA_QUANTIZE)):
        ServeOptions(device="cuda", quantize="int8").validate()


def test_each_process_takes_gpu_index_mod_gpus(monkeypatch):
    current = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    assert [torch_device("cuda", i) for i in range(3)] == [torch.device("cuda", i) for i in (0, 1, 0)]
    assert current == [torch.device("cuda", i) for i in (0, 1, 0)]
    assert torch_device("cpu", 5) == torch.device("cpu") and len(current) == 3


def test_every_executor_gets_the_resolved_device(gpt_run, monkeypatch):  # noqa: F811
    """With a fake CUDA, auto resolves to cuda and each executor is handed it; nothing has touched a GPU yet."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    path = str(gpt_run / "model.safetensors")
    for opts in (ServeOptions(replicas=2), ServeOptions(pp=2, scheduler="static")):
        service = Service(path, opts)  # executors start their processes in start(), not here
        assert service.device == "cuda" and service.executor.device == "cuda"
        # This process's copy is for metadata only: each replica or stage moves its own.
        assert {p.device.type for p in service.served.module.parameters()} == {"cpu"}
        service.codec.shutdown()
    asked = []
    monkeypatch.setattr(service_module, "torch_device", lambda name, index=0: asked.append(name) or torch.device("cpu"))
    service = Service(path, ServeOptions())
    assert service.device == "cuda" and asked == ["cuda"]  # the in-process runner's device
    service.codec.shutdown()
    service = Service(path, ServeOptions(quantize="int8"))
    assert service.device == "cpu"
    service.codec.shutdown()


def test_device_cuda_without_cuda_is_a_one_line_error(gpt_run, capsys, monkeypatch):  # noqa: F811
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # whatever this machine has
    assert main(["serve", str(gpt_run), "--port", "0", "--device", "cuda"]) == 2
    assert capsys.readouterr().err == f"error: {NO_CUDA}\n"
    assert main(["serve", str(gpt_run), "--port", "0", "--device", "cuda", "--quantize", "int8"]) == 2
    assert capsys.readouterr().err == f"error: {CUDA_QUANTIZE}\n"
    with pytest.raises(SystemExit):
        main(["serve", str(gpt_run), "--device", "tpu"])
    assert "invalid choice: 'tpu'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_exits_2(gpt_run):  # noqa: F811
    proc = subprocess.run([sys.executable, "-m", "plait", "serve", str(gpt_run), "--port", "0", "--device", "cuda"],
                          capture_output=True, text=True, env=ENV, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", f"error: {NO_CUDA}\n")


def test_runner_on_explicit_cpu_is_bitwise_the_default(mlp_run):  # noqa: F811
    ref = ModelRef(str(mlp_run / "model.safetensors"))
    x = np.random.default_rng(0).standard_normal((5, 1, 8, 8)).astype(np.float32)
    default, explicit = Runner(load_model(ref), pad_to=8), Runner(load_model(ref), 8, torch_device("cpu"))
    a, b = default.infer(x), explicit.infer(x)
    assert explicit.device == torch.device("cpu") and default.sizes == explicit.sizes
    assert all(np.array_equal(a[k], b[k]) for k in ("logits", "label"))


@pytest.fixture(scope="module")
def reference(gpt_run):  # noqa: F811
    model, meta = load_exported(gpt_run / "model.safetensors")
    return model.eval(), CharTokenizer.from_json(meta["plait.tokenizer"])


def _check_answers(url: str, reference) -> None:
    """Logits, greedy and seeded tokens over HTTP equal the model's own, computed here on CPU."""
    model, tok = reference
    with httpx.Client(base_url=url, timeout=60) as c:
        assert c.get("/v2/models/gpt").json()["parameters"]["device"] == "cpu"
        ids = np.random.default_rng(1).integers(0, model.head.out_features, (3, 10)).astype(np.int64)
        body = {"inputs": [{"name": "input_ids", "shape": [3, 10], "datatype": "INT64", "data": ids.reshape(-1).tolist()}]}
        out = c.post("/v2/models/gpt/infer", json=body).json()["outputs"][0]
        torch.testing.assert_close(torch.tensor(out["data"]).view(out["shape"]), model(torch.from_numpy(ids)), rtol=0, atol=1e-6)
        idx = torch.tensor(tok.encode("def ").astype("int64"))[None]
        greedy = c.post("/v1/generate", json={"prompt": "def ", "max_new_tokens": 40, "temperature": 0}).json()
        assert greedy["tokens"] == model.generate(idx, 40, temperature=0)[0, idx.shape[1]:].tolist()
        sampled = c.post("/v1/generate", json={"prompt": "x", "max_new_tokens": 20, "temperature": 1.0, "seed": 5}).json()
        g = torch.Generator().manual_seed(5)
        assert sampled["tokens"] == model.generate(torch.tensor([[int(tok.encode("x")[0])]]), 20, generator=g)[0, 1:].tolist()
        body = {"prompt": "import os\n", "max_new_tokens": 25, "temperature": 0.8, "top_k": 10, "seed": 11}
        want = generate(model, [GenRow([int(i) for i in tok.encode(body["prompt"])], 25, 0.8, 10, 11)])[0]
        assert c.post("/v1/generate", json=body).json()["tokens"] == want


@pytest.mark.slow
def test_whole_path_with_device_cpu(gpt_run, reference):  # noqa: F811
    """`plait serve --device cpu` in its own process: infer and generation (greedy, seeded) answer as the model does."""
    proc = subprocess.Popen([sys.executable, "-m", "plait", "serve", str(gpt_run / "model.safetensors"), "--port", "0",
                             "--device", "cpu", "--max-delay-ms", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV)
    try:
        assert proc.stdout.readline() == "in-process: starting\n"
        banner = proc.stdout.readline()
        assert " · in-process on cpu" in banner, banner
        _check_answers(re.search(r"at (http://127\.0\.0\.1:\d+)", banner).group(1), reference)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        kill_tree(proc)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"replicas": 2}, {"pp": 2, "scheduler": "static"}], ids=["replicas", "pp"])
def test_replicas_and_stages_with_device_cpu(gpt_run, reference, layout):  # noqa: F811
    with ServerThread(gpt_run / "model.safetensors", ServeOptions(device="cpu", max_delay_ms=0, **layout)) as srv:
        assert srv.service.executor.device == "cpu"
        _check_answers(srv.url, reference)
