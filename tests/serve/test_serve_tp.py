"""--tp 2: tensor-parallel generation over two processes (gloo); greedy tokens equal one process's, each rank holds
half the KV cache's heads, and what cannot be split is refused with the key to change."""

import httpx
import pytest

from plait.serve.entrypoints.server import ServerThread
from plait.serve.errors import ServeError
from plait.serve.service import ServeOptions, Service
from serve.test_serve_openai import PROMPT, decode, hf_greedy  # noqa: F401

openai = pytest.importorskip("openai")


def test_tp2_greedy_text_equals_one_process(hf_dir):  # noqa: F811
    prompts = [PROMPT, "a bird sang in the tree", "the cat sat on the mat and the dog", "the"]
    with ServerThread(hf_dir["dir"], ServeOptions(name="tiny", tp=2, block_size=8, kv_cache_mb=4)) as srv:
        service = srv.service
        assert service.engine.tp == 2 and service.tp_group is not None and len(service.tp_group.procs) == 1
        # this rank's pool holds kv_heads / 2 = 1 head per block slot (the model has 2 kv heads)
        assert next(iter(service.engine.cache.k.values())).shape[0] == 1
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        got = [client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0).choices[0].text
               for p in prompts]
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt=prompts[1], max_tokens=12, temperature=0, stream=True) if c.choices)
        metrics = httpx.get(srv.url + "/metrics").text
        dead = rank_killed_mid_stream(srv)  # last: it takes the group down
    for p, text in zip(prompts, got):
        want = hf_greedy(hf_dir, hf_dir["tok"].encode(p, add_special_tokens=False).ids, 12)
        assert text == decode(hf_dir, [t for t in want if t != hf_dir["eos"]])
    assert streamed == got[1] and "plait_kv_blocks_used 0.0" in metrics
    error, after, ready = dead
    assert error.startswith("generation failed in the engine: TensorParallelDown: --tp 2: rank 1 (pid ")
    assert error.endswith("restart the server") and after == 503 and ready == 503


def rank_killed_mid_stream(srv) -> tuple[str, int, int]:
    """Kill rank 1 while a stream runs: (the stream's error event, the next request's status, readiness)."""
    import json
    import os
    import signal

    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        os.kill(srv.service.tp_group.procs[0].pid, signal.SIGKILL)
        last = [line for line in lines if line.startswith("data: ")][-1]
    error = json.loads(last.removeprefix("data: "))["error"]["message"]
    after = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2}, timeout=60)
    return error, after.status_code, httpx.get(srv.url + "/v2/health/ready").status_code


def test_tp_refuses_what_it_cannot_combine_or_split(hf_dir):  # noqa: F811
    with pytest.raises(ServeError) as e:
        ServeOptions(tp=2, replicas=2).validate()
    assert str(e.value) == "--tp 2 cannot be combined with --replicas in this version of plait; drop one of them"
    with pytest.raises(ServeError) as e:
        Service(str(hf_dir["dir"]), ServeOptions(tp=3))
    assert str(e.value).startswith("--tp 3: model.heads (4) is not divisible by parallel.tp = 3")
