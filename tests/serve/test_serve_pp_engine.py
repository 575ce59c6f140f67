"""--pp 2 for a language model: the continuous-batching engine with the blocks over two processes (the server is
rank 0 with the embedding and block 0, a stage process holds block 1, the norm and the head); greedy tokens equal
transformers', seeded samples equal one process's, each process holds its own blocks and their KV cache only, a
stage that dies ends the streams in flight and the server answers 503 (the last test: it ends the shared server's
stage), and what --pp cannot join is refused before any process starts."""

import asyncio
import json
import multiprocessing
import os
import signal

import httpx
import numpy as np
import pytest
import torch

from plait.models.gpt import GPT
from plait.models.llama import Llama
from plait.parallel.split import pipeline_stage
from plait.serve.engine.paged import PagedCache
from plait.serve.engine.pp import DATA, FAILED, STOP, decode_step, encode_step, recv, send, stage_step
from plait.serve.entrypoints.server import ServerThread
from plait.serve.errors import ServeError
from plait.serve.model.load import ModelRef, load_model
from plait.serve.service import ServeOptions, Service
from serve.test_serve_openai import PROMPT, decode, hf_greedy  # noqa: F401

openai = pytest.importorskip("openai")
OPTS = {"name": "tiny", "block_size": 8, "kv_cache_mb": 1, "max_delay_ms": 0}


@pytest.fixture(scope="module")
def pp2(hf_dir):  # noqa: F811
    with ServerThread(hf_dir["dir"], ServeOptions(pp=2, **OPTS)) as srv:
        yield srv


def client_of(srv) -> "openai.OpenAI":
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_paged_stages_chain_to_the_whole_models_logits(arch):
    """The paged path of a stage without the embedding takes hidden states, one without the head returns them."""
    torch.manual_seed(0)
    model = (Llama(50, 64, 32, 4, 3, kv_heads=2) if arch == "llama" else GPT(50, 64, 32, 4, 3)).eval()
    stages = [pipeline_stage(model, [(0, 1), (1, 3)], r) for r in range(2)]
    caches = [PagedCache(m, 8, 4) for m in (model, *stages)]
    assert [list(c.k) for c in caches] == [["0", "1", "2"], ["0"], ["1", "2"]]
    prefill, decode_ = [([0, 1], 0, 6), ([2, 3], 0, 3)], [([0, 1], 6, 1), ([2, 3], 3, 1)]
    with torch.inference_mode():
        for chunks, ids in ((prefill, torch.randint(0, 50, (1, 9))), (decode_, torch.randint(0, 50, (1, 2)))):
            want = model(ids, cache=caches[0].step(chunks))
            hidden = stages[0](ids, cache=caches[1].step(chunks))
            assert hidden.shape == (1, ids.shape[1], 32)
            torch.testing.assert_close(stages[1](hidden, cache=caches[2].step(chunks)), want)


class Wire:
    """One rank's end of an in-process stand-in for the stages' ProcessGroupGloo: what rank s sends rank d waits in
    boxes[s, d] (gloo's order per pair)."""

    def __init__(self, rank: int, boxes: dict):
        self.rank, self.boxes = rank, boxes

    def send(self, tensors, dst, tag):
        self.boxes.setdefault((self.rank, dst), []).append(tensors[0].clone())
        return self

    def recv(self, tensors, src, tag):
        tensors[0].copy_(self.boxes[src, self.rank].pop(0))
        return self

    def wait(self):
        pass


def test_a_stage_passes_its_error_on_applies_the_copies_and_stops():
    """The wire and one stage's loop, in one process: a step's int64s round-trip, a forward that fails sends its error
    to rank 0 (the step fails, the stage goes on) after the step's block copies, and STOP ends the loop."""
    chunks, copies = [([3, 1], 0, 5), ([2], 6, 1)], [(0, 1), (2, 3)]
    assert decode_step(encode_step(chunks, copies, [4, 5])) == (chunks, copies, [4, 5])
    assert decode_step(encode_step(chunks, [], None)) == (chunks, [], None)
    torch.manual_seed(0)
    stage = pipeline_stage(Llama(50, 64, 32, 4, 2, kv_heads=2), [(0, 1), (1, 2)], 1).eval()
    cache = PagedCache(stage, 4, 4)
    boxes: dict = {}
    first, last = Wire(0, boxes), Wire(1, boxes)
    send(first, 1, DATA, encode_step([([0], 0, 3)], [(0, 2)], None), torch.zeros(1, 3, 16))  # not the width: it fails
    with torch.inference_mode():
        cache.k["1"][:, :4] = 1.0  # block 0
        assert stage_step(last, 1, 2, stage, cache, torch.device("cpu"))
    flag, step, text = recv(first, 1)
    assert flag == FAILED and step is None and bytes(text.tolist()).decode().startswith("pipeline stage 1: RuntimeError")
    assert (cache.k["1"][:, 8:12] == 1.0).all()  # block 2 := block 0 all the same
    send(first, 1, STOP)
    assert not stage_step(last, 1, 2, stage, cache, torch.device("cpu"))  # the last stage sends nothing on
    assert boxes == {(0, 1): [], (1, 0): []}


def test_greedy_text_streamed_and_not_equals_transformers(pp2, hf_dir):  # noqa: F811
    client = client_of(pp2)
    prompts = [PROMPT, "a bird sang in the tree", "the cat sat on the mat and the dog", "the"]
    got = [client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0).choices[0].text
           for p in prompts]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=prompts[1], max_tokens=12, temperature=0, stream=True) if c.choices)
    messages = [{"role": "user", "content": "the cat"}]
    chat = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True) if c.choices)
    for p, text in zip(prompts, got):
        want = hf_greedy(hf_dir, hf_dir["tok"].encode(p, add_special_tokens=False).ids, 12)
        assert text == decode(hf_dir, [t for t in want if t != hf_dir["eos"]])
    assert streamed == got[1]
    ids = hf_dir["tok"].encode("<|user|>the cat\n<|assistant|>", add_special_tokens=False).ids
    assert chat == decode(hf_dir, [t for t in hf_greedy(hf_dir, ids, 8) if t != hf_dir["eos"]])
    # /v2 infer runs one plain forward through both stages: the logits are transformers'
    ids = np.array([hf_dir["tok"].encode(PROMPT, add_special_tokens=False).ids])
    body = {"inputs": [{"name": "input_ids", "shape": list(ids.shape), "datatype": "INT64", "data": ids[0].tolist()}]}
    out = httpx.post(pp2.url + "/v2/models/tiny/infer", json=body, timeout=60).json()["outputs"][0]
    with torch.no_grad():
        want_logits = hf_dir["model"](torch.from_numpy(ids)).logits
    torch.testing.assert_close(torch.tensor(out["data"]).view(out["shape"]), want_logits, rtol=0, atol=1e-5)


def test_seeded_samples_and_logprobs_equal_one_processs(pp2, hf_dir):  # noqa: F811
    kw = {"model": "tiny", "prompt": [PROMPT, "a bird"], "max_tokens": 16, "temperature": 1.0, "top_p": 0.9,
          "seed": 11, "n": 2, "logprobs": 2}
    with ServerThread(hf_dir["dir"], ServeOptions(**OPTS)) as one:
        want = client_of(one).completions.create(**kw)
    got = client_of(pp2).completions.create(**kw)
    assert [c.text for c in got.choices] == [c.text for c in want.choices]
    assert len({c.text for c in got.choices}) > 1  # the seeds drew different texts
    for g, w in zip(got.choices, want.choices):
        assert g.logprobs.tokens == w.logprobs.tokens
        np.testing.assert_allclose(g.logprobs.token_logprobs, w.logprobs.token_logprobs, atol=1e-4)


def test_each_process_holds_its_own_blocks_and_their_kv_cache(pp2, hf_dir):  # noqa: F811
    whole = load_model(ModelRef(str(hf_dir["dir"]))).module
    size = {name: sum(p.numel() for p in module.parameters())
            for name, module in (("tok_emb", whole.tok_emb), ("norm", whole.norm), ("head", whole.head),
                                 *((f"block {i}", whole.blocks[i]) for i in ("0", "1")))}
    service = pp2.service
    group, engine = service.pp_group, service.engine
    from plait.serve.entrypoints.server import banner_lines  # the engine's line says where the blocks are

    assert banner_lines(service, pp2.url)[1].endswith(" · blocks split over 2 pipeline stages")
    first, last = group.stages
    assert (first.pid, first.bounds, first.layers) == (os.getpid(), (0, 1), ("0",))
    assert last.pid != os.getpid() and last.pid == group.procs[0].pid and (last.bounds, last.layers) == ((1, 2), ("1",))
    assert first.parameters == size["tok_emb"] + size["block 0"] == sum(p.numel() for p in engine.model.parameters())
    assert last.parameters == size["block 1"] + size["norm"] + size["head"]
    assert engine.model.head is None and set(engine.cache.k) == {"0"}
    # one layer's keys and values per block in each process (2 kv heads x 8 head dims x 8 tokens, float32), as many
    # blocks as --kv-cache-mb holds for one layer, the same block ids in both
    per_block = 2 * 8 * 2 * 8 * 4
    assert engine.pool.num_blocks == group.num_blocks == 2**20 // per_block
    assert first.cache_bytes == last.cache_bytes == group.num_blocks * per_block == 2**20


def test_pp_refuses_what_it_cannot_join_before_any_process_starts(hf_dir, monkeypatch):  # noqa: F811
    before = multiprocessing.active_children()
    for extra, message in (
            ({"tp": 2}, "--tp 2 cannot be combined with --pp in this version of plait; drop one of them"),
            ({"draft": str(hf_dir["dir"])}, "--draft needs the whole model in the server's process; drop --replicas, "
                                            "--pp and --autoscale"),
            ({"lora": ("sql=adapter.safetensors",)}, "--lora needs the continuous-batching engine with the whole model "
                                                     "in the server's process; drop --scheduler static, --replicas, "
                                                     "--pp and --autoscale")):
        with pytest.raises(ServeError) as e:
            Service(str(hf_dir["dir"]), ServeOptions(pp=2, **extra))
        assert str(e.value) == message
    with pytest.raises(ServeError, match=r"^--pp 3: the model has 2 blocks; use --pp between 1 and 2$"):
        Service(str(hf_dir["dir"]), ServeOptions(pp=3))
    assert multiprocessing.active_children() == before
    from plait import cli
    from plait.serve import commands as server  # the verb runs plait.serve.commands.run

    seen = {}
    monkeypatch.setattr(server, "run", lambda path, opts: seen.update(opts=opts) or 0)
    assert cli.main(["serve", str(hf_dir["dir"]), "--pipeline-parallel-size", "2"]) == 0  # vLLM's name for --pp
    assert seen["opts"].pp == 2


def test_a_stage_that_dies_ends_the_streams_in_flight_and_the_server_answers_503(pp2):
    """Last in this file: it ends the shared server's stage process."""
    group = pp2.service.pp_group
    pid = group.stages[1].pid
    why = f"pipeline stage 1 (pid {pid}) died with exit code -9; the pipeline is down (restart the server)"
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 240, "temperature": 0, "stream": True, "ignore_eos": True}
    started = [asyncio.Event() for _ in range(3)]

    async def stream(i: int, client: httpx.AsyncClient) -> list[str]:
        lines = []
        async with client.stream("POST", pp2.url + "/v1/completions", json=body | {"seed": i}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line.removeprefix("data: "))
                    if len(lines) == 2:
                        started[i].set()
        return lines

    async def kill() -> None:
        for event in started:
            await event.wait()
        os.kill(pid, signal.SIGKILL)  # the streams have about 238 tokens to go

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(stream(i, client) for i in range(3)), kill())

    for lines in asyncio.run(main())[:3]:
        error = json.loads(lines[-1])["error"]
        assert error["message"] == f"generation failed in the engine: PipelineDown: {why}" and len(lines) < 240
        assert error["type"] == "server_error"
    with pytest.raises(openai.InternalServerError) as e:
        client_of(pp2).completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
    assert e.value.status_code == 503 and e.value.body["message"] == f"generation failed in the engine: PipelineDown: {why}"
    body = {"inputs": [{"name": "input_ids", "shape": [1, 2], "datatype": "INT64", "data": [5, 6]}]}
    r = httpx.post(pp2.url + "/v2/models/tiny/infer", json=body, timeout=60)
    assert (r.status_code, r.json()["error"]) == (503, why)
    assert httpx.get(pp2.url + "/v2/health/ready").status_code == 503
    assert group.down == why and not group.procs[0].is_alive()
