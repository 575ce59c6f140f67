"""Pipeline-parallel serving: K stage processes (training's split) answer like the single-process model."""

import os
import signal

import httpx
import numpy as np
import pytest
import torch

from plait.data.tokenizer import CharTokenizer
from plait.export import load_exported
from plait.serve.entrypoints.server import ServerThread
from plait.serve.errors import ServeError
from plait.serve.service import ServeOptions, Service
from serve_helpers import gpt_run, mlp_run, poll  # noqa: F401

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(gpt_run):  # noqa: F811
    model, meta = load_exported(gpt_run / "model.safetensors")
    return model.eval(), CharTokenizer.from_json(meta["plait.tokenizer"])


def test_two_stages_answer_like_one_process_then_fail_fast_when_a_stage_dies(gpt_run, reference):  # noqa: F811
    model, tok = reference
    with ServerThread(gpt_run / "model.safetensors", ServeOptions(pp=2, max_batch_size=8, max_delay_ms=1,
                                                                       scheduler="static")) as srv:
        pp = srv.service.executor
        assert pp.bounds == [(0, 1), (1, 2)] and len(set(pp.pids)) == 2 and os.getpid() not in pp.pids
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            assert c.get("/v2/models/gpt").json()["parameters"]["layout"] == "2 pipeline stages"
            ids = np.random.default_rng(0).integers(0, model.head.out_features, (5, 12)).astype(np.int64)
            body = {"inputs": [{"name": "input_ids", "shape": [5, 12], "datatype": "INT64", "data": ids.reshape(-1).tolist()}]}
            out = c.post("/v2/models/gpt/infer", json=body).json()["outputs"][0]
            logits = torch.tensor(out["data"]).view(out["shape"])
            torch.testing.assert_close(logits, model(torch.from_numpy(ids)), rtol=0, atol=1e-6)  # 5 rows: 2 micro-batches
            for prompt in ("def ", "import os\n"):
                got = c.post("/v1/generate", json={"prompt": prompt, "max_new_tokens": 40, "temperature": 0}).json()
                idx = torch.tensor(tok.encode(prompt).astype("int64"))[None]
                assert got["tokens"] == model.generate(idx, 40, temperature=0)[0, idx.shape[1]:].tolist()
            sampled = {"prompt": "x", "max_new_tokens": 20, "temperature": 1.0, "seed": 5}
            g = torch.Generator().manual_seed(5)
            want = model.generate(torch.tensor([[int(tok.encode("x")[0])]]), 20, generator=g)[0, 1:].tolist()
            assert c.post("/v1/generate", json=sampled).json()["tokens"] == want

            os.kill(pp.pids[1], signal.SIGKILL)
            poll(lambda: c.get("/v2/health/ready").status_code == 503, 30, "not ready")
            r = c.post("/v2/models/gpt/infer", json=body)
            assert r.status_code == 503
            assert r.json()["error"] == f"pipeline stage 1 (pid {pp.pids[1]}) died with exit code -9; the pipeline is down"
    assert not any(p.is_alive() for p in pp._procs)


def test_models_that_cannot_be_cut(mlp_run, gpt_run):  # noqa: F811
    with pytest.raises(ServeError, match=r"--pp 2: a mlp model cannot be cut into pipeline stages \(it has no "
                                         r"pipeline_parts\(\)\); serve it with --replicas instead"):
        Service(str(mlp_run), ServeOptions(pp=2))
    with pytest.raises(ServeError, match=r"--pp 3: the model has 2 blocks; use --pp between 1 and 2"):
        Service(str(gpt_run), ServeOptions(pp=3))
