"""Text generation for gpt runs: KV cache == no cache == GPT.generate, batching, seeds, streaming, bad requests."""

import asyncio
import json

import httpx
import numpy as np
import pytest
import torch

from plait.data.tokenizer import CharTokenizer
from plait.export import load_exported
from plait.serve.entrypoints.server import ServerThread
from plait.serve.executor.generate import GenRow, generate
from plait.serve.service import ServeOptions
from serve_helpers import gather_posts, gpt_run  # noqa: F401

PROMPTS = ["def ", "import os\n", "class Heap(object):\n    ", "x"]


@pytest.fixture(scope="module")
def model_and_tok(gpt_run):  # noqa: F811
    model, meta = load_exported(gpt_run / "model.safetensors")
    return model.eval(), CharTokenizer.from_json(meta["plait.tokenizer"])


@pytest.fixture(scope="module")
def server(gpt_run):  # noqa: F811
    """Static batches (whole batches generated together): four requests wait for each other."""
    with ServerThread(gpt_run / "model.safetensors", ServeOptions(max_batch_size=4, max_delay_ms=3000,
                                                                  scheduler="static")) as srv:
        yield srv


@pytest.fixture(scope="module")
def lone(gpt_run):  # noqa: F811
    """Continuous batching (the default): no waiting for company, each request joins the engine's batch at once."""
    with ServerThread(gpt_run / "model.safetensors", ServeOptions(max_delay_ms=0)) as srv:
        yield srv


def reference_tokens(model, tok, prompt: str, n: int) -> list[int]:
    idx = torch.tensor(tok.encode(prompt).astype("int64"))[None]
    return model.generate(idx, n, temperature=0)[0, idx.shape[1]:].tolist()


def test_kv_cache_gives_the_tokens_of_full_recompute(model_and_tok):
    model, tok = model_and_tok
    assert model.context == 32
    for prompt in PROMPTS:
        ids = [int(i) for i in tok.encode(prompt)]
        want = reference_tokens(model, tok, prompt, 40)  # runs past the context window: positions shift
        assert generate(model, [GenRow(ids, 40)]) == [want]
        assert generate(model, [GenRow(ids, 40)], use_cache=False) == [want]
    rows = [GenRow([int(i) for i in tok.encode(p)], n) for p, n in zip(PROMPTS, (5, 40, 12, 1))]
    batched = generate(model, rows)  # left-padded together, different lengths and budgets
    assert batched == [reference_tokens(model, tok, p, n) for p, n in zip(PROMPTS, (5, 40, 12, 1))]


def test_greedy_requests_batched_over_http_equal_generate(server, model_and_tok):
    model, tok = model_and_tok
    bodies = [{"prompt": p, "max_new_tokens": 20, "temperature": 0} for p in PROMPTS]
    rs = asyncio.run(gather_posts(server.url + "/v1/generate", bodies))
    metrics = httpx.get(server.url + "/metrics").text
    assert "plait_batch_size_count 1.0" in metrics and "plait_batch_size_sum 4.0" in metrics  # one batch of 4
    for p, r in zip(PROMPTS, rs):
        assert r.status_code == 200, r.text
        want = reference_tokens(model, tok, p, 20)
        assert r.json()["tokens"] == want and r.json()["text"] == tok.decode(want)
        assert r.json()["prompt_tokens"] == len(p) and r.json()["model"] == "gpt"


def test_same_seed_same_text_alone_or_batched(server, lone):
    body = {"prompt": "def ", "max_new_tokens": 30, "temperature": 1.0, "top_k": 20, "seed": 7}
    others = [{"prompt": p, "max_new_tokens": 30, "temperature": 0.8, "seed": i} for i, p in enumerate(PROMPTS[1:])]
    batched = asyncio.run(gather_posts(server.url + "/v1/generate", [body, *others]))[0].json()
    with httpx.Client(base_url=lone.url, timeout=60) as c:
        alone = c.post("/v1/generate", json=body).json()
        again = c.post("/v1/generate", json=body).json()
        other_seed = c.post("/v1/generate", json=body | {"seed": 8}).json()
        unseeded = c.post("/v1/generate", json={k: v for k, v in body.items() if k != "seed"}).json()
        replay = c.post("/v1/generate", json=body | {"seed": unseeded["seed"]}).json()
    assert alone["text"] == again["text"] == batched["text"] and alone["seed"] == 7
    assert other_seed["text"] != alone["text"]
    assert replay["text"] == unseeded["text"]  # the seed the server chose is reported, and reproduces the text


def test_streaming_sends_each_token_then_the_whole_text(lone):
    body = {"prompt": "import ", "max_new_tokens": 15, "temperature": 0.9, "seed": 3}
    with httpx.Client(base_url=lone.url, timeout=60) as c:
        whole = c.post("/v1/generate", json=body).json()
        with c.stream("POST", "/v1/generate", json=body | {"stream": True}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = [e for e in r.read().decode().split("\n\n") if e]
    tokens = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert [t["index"] for t in tokens] == list(range(15))
    assert [t["token"] for t in tokens] == whole["tokens"]
    assert "".join(t["text"] for t in tokens) == whole["text"]
    kind, data = events[-1].split("\n")
    assert kind == "event: done" and json.loads(data.removeprefix("data: "))["text"] == whole["text"]


@pytest.mark.parametrize("body, status, message", [
    ({}, 400, "'prompt' must be a non-empty string"),
    ({"prompt": ""}, 400, "'prompt' must be a non-empty string"),
    ({"prompt": "a", "max_new_tokens": 0}, 400, "'max_new_tokens' must be an integer between 1 and 1024, got 0"),
    ({"prompt": "a", "max_new_tokens": 5000}, 400, "'max_new_tokens' must be an integer between 1 and 1024, got 5000"),
    ({"prompt": "a", "temperature": -1}, 400, "'temperature' must be a number between 0 and 100 (0: greedy), got -1"),
    ({"prompt": "a", "top_k": "many"}, 400, "'top_k' must be an integer between 1 and 2147483648, got 'many'"),
    ({"prompt": "a", "stream": "yes"}, 400, "'stream' must be true or false"),
    ({"prompt": "a", "temprature": 1}, 400, "unknown field 'temprature'; /v1/generate takes: max_new_tokens, model, "
                                            "prompt, seed, stream, temperature, top_k"),
    ({"prompt": "a", "model": "mlp"}, 404, "unknown model 'mlp'; this server serves: gpt"),
    (["a"], 400, "request body must be a JSON object with a 'prompt'"),
])
def test_bad_generate_requests(lone, body, status, message):
    r = httpx.post(lone.url + "/v1/generate", json=body)
    assert r.status_code == status and r.json()["error"] == message


def test_logits_over_the_protocol(lone, model_and_tok):
    model, _ = model_and_tok
    ids = np.random.default_rng(0).integers(0, model.head.out_features, (2, 9)).astype(np.int64)
    body = {"inputs": [{"name": "input_ids", "shape": [2, 9], "datatype": "INT64", "data": ids.reshape(-1).tolist()}]}
    with httpx.Client(base_url=lone.url, timeout=60) as c:
        out = c.post("/v2/models/gpt/infer", json=body).json()["outputs"][0]
        vocab = model.head.out_features
        assert out["shape"] == [2, 9, vocab] and out["datatype"] == "FP32"
        logits = torch.tensor(out["data"]).view(2, 9, vocab)
        torch.testing.assert_close(logits, model(torch.from_numpy(ids)), rtol=0, atol=1e-5)
        bad = ids.copy()
        bad[0, 0] = vocab
        r = c.post("/v2/models/gpt/infer", json={"inputs": [body["inputs"][0] | {"data": bad.reshape(-1).tolist()}]})
        assert r.status_code == 400 and r.json()["error"] == f"input 'input_ids' holds ids outside [0, {vocab}) (the vocabulary)"
        long = {"name": "input_ids", "shape": [1, 33], "datatype": "INT64", "data": [1] * 33}
        r = c.post("/v2/models/gpt/infer", json={"inputs": [long]})
        assert r.status_code == 400 and r.json()["error"] == "input 'input_ids' has 33 tokens; the model's context is 32"
