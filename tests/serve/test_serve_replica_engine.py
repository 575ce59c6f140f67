"""The continuous-batching engine behind `--replicas 2` (issue 55 item 6), driven by the official `openai` client on a
tiny random Hugging Face Llama: transformers' greedy tokens streamed and not, seeded samples equal to the in-process
server's, a cancelled stream's blocks back in its replica's pool, requests sharing a system prompt routed to the
replica that caches it, a higher prefix-cache hit rate than least-loaded routing, and a replica that dies mid-stream
ending its stream with an error and coming back. One pool of replica processes serves every test (they take
seconds to start); the test that kills a replica comes last."""

import asyncio
import os
import pickle
import random
import signal
import time

import httpx
import pytest
import torch

from plait.serve.engine.core import TokenEvent
from plait.serve.engine.sampling import SamplingParams
from plait.serve.entrypoints.server import ServerThread
from plait.serve.executor.sequences import EngineSequences
from plait.serve.executor.tasks import Cancel, Complete, CompleteOutput, Done, Stats, Submit, Token
from plait.serve.fleet.replicas import ReplicaPool
from plait.serve.service import ServeOptions
from serve.test_serve_openai import CORPUS, PROMPT, TOKEN, decode, hf_greedy  # noqa: F401

openai = pytest.importorskip("openai")
WORDS = sorted(set(CORPUS.split()))


@pytest.fixture(scope="module")
def fleet(hf_dir):  # noqa: F811
    opts = ServeOptions(name="tiny", token=TOKEN, replicas=2, block_size=8, kv_cache_mb=4)
    with ServerThread(hf_dir["dir"], opts) as srv:
        yield srv
    assert not any(r.proc.is_alive() for r in srv.service.executor._replicas if r is not None)


@pytest.fixture(scope="module")
def client(fleet):
    return openai.OpenAI(base_url=fleet.url + "/v1", api_key=TOKEN, max_retries=0, timeout=60)


def ids_of(hf_dir, text: str) -> list[int]:  # noqa: F811
    return hf_dir["tok"].encode(text, add_special_tokens=False).ids


def token_ids(logprobs) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in logprobs.tokens]


def hf_ignoring_eos(hf_dir, ids: list[int], n: int) -> list[int]:  # noqa: F811
    with torch.no_grad():
        out = hf_dir["model"].generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                       pad_token_id=hf_dir["eos"])
    return out[0, len(ids):].tolist()


def system_prompt(seed: int, words: int = 30) -> str:
    return " ".join(random.Random(seed).choices(WORDS, k=words))


def wait_for(predicate, timeout_s: float = 30.0):
    end = time.monotonic() + timeout_s
    while not (value := predicate()) and time.monotonic() < end:
        time.sleep(0.02)
    return value


def test_the_new_task_and_messages_cross_a_pipe():
    params = SamplingParams(8, 0.7, 5, 0.9, 3, frozenset({2}), logprobs=1)
    event = TokenEvent(7, 0, -0.5, ((7, -0.5),), ((-1.0, ()),))
    for msg in (Submit(1, Complete((1, 2, 3), params, 0)), Cancel(1, (0,)), Token(1, 0, 0, 7, event),
                Stats({"hit_tokens": 3, "query_tokens": 4})):
        assert pickle.loads(pickle.dumps(msg)) == msg
    assert pickle.loads(pickle.dumps(Done(1, CompleteOutput("error", "RuntimeError: x")))).result == CompleteOutput(
        "error", "RuntimeError: x")  # (Done compares by identity: an InferOutput's arrays have no single truth value)
    assert Complete.kind == "complete"


def test_each_replica_runs_the_engine_and_greedy_tokens_equal_transformers(fleet, client, hf_dir):  # noqa: F811
    service, pool = fleet.service, fleet.service.executor
    assert isinstance(pool, ReplicaPool) and service.engine is None and service.remote_engine
    assert [s["blocks"] for s in pool.engine_stats()] == [2048, 2048]
    from plait.serve.entrypoints.server import banner_lines  # the engine's line, not the batcher's, and its routes

    _, how, routes = banner_lines(service, fleet.url)
    assert how.startswith("  engine: continuous batching · in each of 2 replicas (prefix routing), KV cache 4 MB")
    assert f"{fleet.url}/v1/chat/completions" in routes
    want = hf_ignoring_eos(hf_dir, ids_of(hf_dir, PROMPT), 12)
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0,
              extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert token_ids(client.completions.create(**kw).choices[0].logprobs) == want
    streamed = [t for c in client.completions.create(**kw, stream=True) if c.choices and c.choices[0].logprobs
                for t in token_ids(c.choices[0].logprobs)]
    assert streamed == want
    messages = [{"role": "user", "content": "the cat"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    text = "<|user|>the cat\n<|assistant|>"
    greedy = hf_greedy(hf_dir, ids_of(hf_dir, text), 8)
    assert chat.choices[0].message.content == decode(hf_dir, [t for t in greedy if t != hf_dir["eos"]])
    chunks = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    # /v1/generate takes the replicas' engines too (not the static batches)
    r = httpx.post(fleet.url + "/v1/generate", json={"prompt": PROMPT, "max_new_tokens": 6, "temperature": 0},
                   headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    assert r.json()["tokens"] == hf_greedy(hf_dir, ids_of(hf_dir, PROMPT), 6)
    assert sum(s["finished"].get("length", 0) + s["finished"].get("stop", 0) for s in pool.engine_stats()) == 5


def test_seeded_samples_equal_the_in_process_servers(fleet, client, hf_dir):  # noqa: F811
    kw = dict(model="tiny", prompt=[PROMPT, "a bird"], max_tokens=16, temperature=0.9, top_p=0.95, n=2, seed=11,
              logprobs=1)
    remote = client.completions.create(**kw)
    with ServerThread(hf_dir["dir"], ServeOptions(name="tiny", token=TOKEN, block_size=8, kv_cache_mb=4)) as srv:
        local = openai.OpenAI(base_url=srv.url + "/v1", api_key=TOKEN, max_retries=0, timeout=60)
        here = local.completions.create(**kw)
    assert [c.text for c in remote.choices] == [c.text for c in here.choices]
    assert len({c.text for c in remote.choices}) > 1  # the samples differ from each other: the seeds were used
    for a, b in zip(remote.choices, here.choices):
        assert a.logprobs.token_logprobs == pytest.approx(b.logprobs.token_logprobs, abs=1e-5)
    streamed = ["", "", "", ""]
    for c in client.completions.create(**kw, stream=True):
        streamed[c.choices[0].index] += c.choices[0].text
    assert streamed == [c.text for c in here.choices]


def test_sequences_sharing_a_system_prompt_go_to_the_replica_that_caches_it(fleet, client, hf_dir):  # noqa: F811
    pool = fleet.service.executor
    for i in range(2):
        pool.router.forget(i)  # a router with nothing remembered: its choices below depend on this test alone
    first = len(pool.router.routes)
    hits = [s["hit_tokens"] for s in pool.engine_stats()]
    a, b = system_prompt(1), system_prompt(2)
    blocks = len(ids_of(hf_dir, a)) // 8
    for question in ("the cat", "a red ball", "the old wall"):
        for system in (a, b):
            client.completions.create(model="tiny", prompt=f"{system} {question}", max_tokens=2, temperature=0)
    routes = list(pool.router.routes)[first:]
    assert [r.replica for r in routes] == [0, 1] * 3  # a on replica 0 (the first cold prompt), b on the other
    assert [r.reason for r in routes] == ["cold"] * 2 + ["prefix"] * 4
    assert all(r.matched >= blocks for r in routes[2:])
    gained = [s["hit_tokens"] - h for s, h in zip(pool.engine_stats(), hits)]
    assert min(gained) >= 2 * blocks * 8  # each replica found its system prompt's blocks for the two that followed


def test_prefix_routing_finds_more_prompt_tokens_cached_than_least_loaded(fleet, client):
    pool = fleet.service.executor

    def hit_rate(policy: str, seed: int) -> float:
        pool.router.policy = policy
        systems = [system_prompt(seed + k, words=24) for k in range(3)]
        before = pool.engine_totals()
        for question in ("the cat", "a bird sang", "near the river", "children played"):
            for system in systems:
                client.completions.create(model="tiny", prompt=f"{system} {question}", max_tokens=1, temperature=0)
        after = pool.engine_totals()
        return (after["hit_tokens"] - before["hit_tokens"]) / (after["query_tokens"] - before["query_tokens"])

    try:
        least = hit_rate("least-loaded", 100)
        prefix = hit_rate("prefix", 200)
    finally:
        pool.router.policy = "prefix"
    assert prefix > least + 0.15, (prefix, least)  # 3 cold prompts of 12 against 6 of 12
    metrics = httpx.get(fleet.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    shown = next(float(line.split()[1]) for line in metrics.splitlines()
                 if line.startswith("plait_prefix_cache_hit_rate "))
    assert shown == pytest.approx(pool.engine_totals()["prefix_hit_rate"])


def test_a_cancelled_stream_frees_its_blocks_in_the_replica(fleet):
    pool = fleet.service.executor
    aborted = [s["finished"].get("abort", 0) for s in pool.engine_stats()]
    generated = [s["generated"] for s in pool.engine_stats()]
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 240, "temperature": 0.8, "seed": 3, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", fleet.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == 2:
                break  # the client goes away mid-stream
    replica = pool.router.routes[-1].replica
    assert wait_for(lambda: pool.engine_stats()[replica]["finished"].get("abort", 0) == aborted[replica] + 1)
    stats = pool.engine_stats()[replica]
    assert stats["blocks_used"] == 0 and stats["running"] == stats["waiting"] == 0
    assert stats["generated"] - generated[replica] < 240  # it stopped early, it did not run to max_tokens
    assert not any(pool.running())  # nothing in flight at the pool either


class OnlyToken:
    """A grammar that allows one token (a TokenMask): picklable, by reference to this module."""

    TOKEN = 5

    def allowed(self, vocab: int) -> torch.Tensor:
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[self.TOKEN] = True
        return mask

    def accept(self, token: int) -> None:
        pass

    def finished(self) -> bool:
        return False


def test_a_grammar_crosses_to_a_replica_when_it_pickles_else_runs_here(fleet):
    service = fleet.service
    loop = service.executor._loop

    def tokens(grammar) -> list[int]:
        params = SamplingParams(4, 0.0, grammar=grammar)
        done = asyncio.run_coroutine_threadsafe(service.complete([3, 4, 5], params, time.perf_counter()), loop)
        return [ev.token for ev in done.result(60).events]

    assert service._sequences_for(SamplingParams(4, grammar=OnlyToken)) is service.executor
    assert tokens(OnlyToken) == [OnlyToken.TOKEN] * 4  # masked in the replica's sampler
    assert service._grammar_engine is None
    factory = lambda: OnlyToken()  # noqa: E731 (a lambda does not pickle)
    assert isinstance(service._sequences_for(SamplingParams(4, grammar=factory)), EngineSequences)
    assert tokens(factory) == [OnlyToken.TOKEN] * 4
    assert service._grammar_engine is not None and service._grammar_engine.generated == 4


def test_a_replica_that_dies_mid_stream_ends_its_stream_with_an_error_and_is_replaced(fleet, client, hf_dir):  # noqa: F811
    pool = fleet.service.executor
    pids = pool.pids()
    stream = iter(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=240, temperature=0.8, seed=1,
                                            stream=True, extra_body={"ignore_eos": True}))
    next(stream)
    victim = pool.router.routes[-1].replica
    os.kill(pids[victim], signal.SIGKILL)
    with pytest.raises(openai.APIError, match=rf"replica {victim} \(pid {pids[victim]}\) died with exit code -9 "
                                              r"after streaming \d+ token\(s\) of this sequence"):
        for _ in stream:
            pass
    assert wait_for(lambda: pool.restarts == 1 and all(pool.pids()), 120)
    assert pool.pids()[victim] != pids[victim] and pool.pids()[1 - victim] == pids[1 - victim]
    assert victim not in pool.router.keys  # what the router remembered of its cache died with it
    want = hf_ignoring_eos(hf_dir, ids_of(hf_dir, PROMPT), 6)
    pool.router.policy = "round-robin"  # one request for each replica
    try:
        for _ in range(2):
            r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0,
                                          extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
            assert token_ids(r.choices[0].logprobs) == want
    finally:
        pool.router.policy = "prefix"
    assert pool.engine_stats()[victim]["finished"] == {"length": 1}  # the new process's engine answered
