"""The OpenAI API as vLLM serves it, field by field, with the official `openai` client on a random HF Llama, each
against a reference computed here from transformers' own logits: penalties, logit_bias, min_tokens, ignore_eos,
stop_token_ids, special tokens left out of the text, echo with the prompt's log-probabilities, best_of,
return_tokens_as_token_ids, max_tokens bounded by the context, /tokenize and /detokenize, seeds across restarts, and
vLLM's command-line flags."""

import httpx
import pytest
import torch

from plait.serve.entrypoints.server import ServerThread
from plait.serve.service import ServeOptions
from serve.test_serve_openai import PROMPT, TOKEN  # noqa: F401

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(hf_dir):  # noqa: F811
    with ServerThread(hf_dir["dir"], ServeOptions(name="tiny", token=TOKEN, block_size=8, kv_cache_mb=4)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=TOKEN, max_retries=0, timeout=60)


def ids_of(hf_dir, text: str) -> list[int]:  # noqa: F811
    return hf_dir["tok"].encode(text, add_special_tokens=False).ids


@torch.no_grad()
def greedy_with(hf_dir, ids: list[int], n: int, process) -> list[int]:  # noqa: F811
    """Greedy decoding with `process(logits, prompt, output) -> logits` on transformers' last logits each step."""
    out: list[int] = []
    for _ in range(n):
        logits = hf_dir["model"](torch.tensor([ids + out])).logits[0, -1].float()
        out.append(int(process(logits.clone(), ids, out).argmax()))
    return out


def token_ids(choice) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]


def test_presence_and_frequency_penalties_follow_openais_formula(client, hf_dir):  # noqa: F811
    ids = ids_of(hf_dir, PROMPT)

    def penalize(logits, prompt, out):
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel()).float()
        return logits - 0.7 * counts - 1.5 * (counts > 0).float()

    want = greedy_with(hf_dir, ids, 16, penalize)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, frequency_penalty=0.7,
                                  presence_penalty=1.5, logprobs=0, extra_body={"return_tokens_as_token_ids": True,
                                                                                "ignore_eos": True})
    assert token_ids(r.choices[0]) == want
    plain = greedy_with(hf_dir, ids, 16, lambda lg, p, o: lg)
    assert want != plain  # the penalties changed the text: the test could fail


def test_repetition_penalty_equals_transformers(client, hf_dir):  # noqa: F811
    ids = ids_of(hf_dir, PROMPT)
    with torch.no_grad():
        want = hf_dir["model"].generate(torch.tensor([ids]), max_new_tokens=14, do_sample=False, repetition_penalty=1.8,
                                        eos_token_id=None, pad_token_id=hf_dir["eos"])[0, len(ids):].tolist()
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=14, temperature=0, logprobs=0,
                                  extra_body={"repetition_penalty": 1.8, "return_tokens_as_token_ids": True,
                                              "ignore_eos": True})
    assert token_ids(r.choices[0]) == want
    assert want != greedy_with(hf_dir, ids, 14, lambda lg, p, o: lg)


def test_logit_bias_min_tokens_ignore_eos_and_stop_token_ids(client, hf_dir):  # noqa: F811
    eos, ids = hf_dir["eos"], ids_of(hf_dir, PROMPT)
    forced = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                       logit_bias={str(eos): 100})
    assert forced.choices[0].finish_reason == "stop" and forced.usage.completion_tokens == 1
    assert forced.choices[0].text == ""  # </s> is a special token: left out of the text
    raw = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logit_bias={str(eos): 100},
                                    extra_body={"skip_special_tokens": False})
    assert raw.choices[0].text == "</s>"
    late = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0,
                                     logit_bias={str(eos): 100},
                                     extra_body={"min_tokens": 3, "return_tokens_as_token_ids": True})

    def masked(logits, prompt, out):
        logits[eos] += 100
        if len(out) < 3:
            logits[eos] = float("-inf")
        return logits

    assert token_ids(late.choices[0]) == greedy_with(hf_dir, ids, 4, masked)
    assert late.usage.completion_tokens == 4 and late.choices[0].finish_reason == "stop"
    ignored = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0,
                                        logit_bias={str(eos): 100}, extra_body={"ignore_eos": True})
    assert ignored.usage.completion_tokens == 5 and ignored.choices[0].finish_reason == "length"
    plain = greedy_with(hf_dir, ids, 6, lambda lg, p, o: lg)
    stopped = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0,
                                        extra_body={"stop_token_ids": [plain[2]], "return_tokens_as_token_ids": True})
    first = plain.index(plain[2])
    assert token_ids(stopped.choices[0]) == plain[:first + 1] and stopped.choices[0].finish_reason == "stop"


def test_echo_returns_the_prompt_and_its_log_probabilities(client, hf_dir):  # noqa: F811
    ids = ids_of(hf_dir, PROMPT)
    for stream in (False, True):
        kw = dict(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1)
        if stream:
            chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
            text = "".join(c.text for c in chunks)
            lps = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
        else:
            r = client.completions.create(**kw)
            text, lps = r.choices[0].text, r.choices[0].logprobs.token_logprobs
        out = greedy_with(hf_dir, ids, 4, lambda lg, p, o: lg)
        with torch.no_grad():
            ref = torch.log_softmax(hf_dir["model"](torch.tensor([ids + out])).logits[0].float(), -1)
        whole = ids + out
        assert text.startswith(PROMPT) and len(lps) == len(whole)
        assert lps[0] is None
        assert lps[1:] == pytest.approx([float(ref[i - 1, whole[i]]) for i in range(1, len(whole))], abs=1e-4)


def test_best_of_answers_the_candidate_of_the_highest_mean_logprob(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=7)
    every = client.completions.create(n=4, logprobs=0, extra_body={"ignore_eos": True}, **kw)
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in every.choices]
    best = client.completions.create(n=1, best_of=4, extra_body={"ignore_eos": True}, **kw)
    assert best.choices[0].text == every.choices[means.index(max(means))].text
    assert len(set(c.text for c in every.choices)) > 1


def test_max_tokens_is_bounded_by_the_context_and_chat_defaults_to_what_is_left(client, server, hf_dir):  # noqa: F811
    messages = [{"role": "user", "content": "the cat"}]
    r = client.chat.completions.create(model="tiny", messages=messages, temperature=0, extra_body={"ignore_eos": True})
    prompt = r.usage.prompt_tokens
    assert r.usage.completion_tokens == 256 - prompt and r.choices[0].finish_reason == "length"
    c = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_completion_tokens=3,
                                       extra_body={"ignore_eos": True})
    assert c.usage.completion_tokens == 3
    by_path = client.completions.create(model=str(hf_dir["dir"]), prompt=PROMPT, max_tokens=2)
    assert by_path.model == str(hf_dir["dir"]) and by_path.usage.completion_tokens <= 2
    listed = client.models.list().data[0]
    assert listed.id == "tiny" and listed.model_extra["max_model_len"] == 256


def test_the_banner_shows_the_engine_and_every_route(server):
    from plait.serve.entrypoints.server import banner_lines

    head, how, routes = banner_lines(server.service, server.url)
    assert head.startswith(f"serving 'tiny' (llama, lm, checkpoint -) at {server.url} · in-process on cpu")
    blocks = server.service.engine.pool.num_blocks
    assert how == (f"  engine: continuous batching · KV cache {blocks} blocks x 8 tokens (4 MB) · max 128 sequences, 2048 "
                   "prompt tokens a step · prefix caching on · context 256 tokens")
    assert routes.split("  ·  ")[2:7] == [server.url + p for p in ("/v1/completions", "/v1/chat/completions",
                                                                  "/v1/models", "/tokenize", "/detokenize")]


def test_tokenize_and_detokenize(server, hf_dir):  # noqa: F811
    h = {"Authorization": f"Bearer {TOKEN}"}
    r = httpx.post(server.url + "/tokenize", headers=h, json={"model": "tiny", "prompt": PROMPT,
                                                              "return_token_strs": True}).json()
    assert r["tokens"] == ids_of(hf_dir, PROMPT) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    assert "".join(r["token_strs"]).replace(" ", "") == PROMPT.replace(" ", "")
    d = httpx.post(server.url + "/detokenize", headers=h, json={"tokens": r["tokens"]}).json()
    assert d == {"prompt": hf_dir["tok"].decode(r["tokens"])}
    chat = httpx.post(server.url + "/tokenize", headers=h, json={"messages": [{"role": "user", "content": "a"}]}).json()
    assert chat["tokens"] == ids_of(hf_dir, "<|user|>a\n<|assistant|>")
    bad = httpx.post(server.url + "/detokenize", headers=h, json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


@pytest.mark.parametrize("body, param, message", [
    ({"temperature": 0, "min_tokens": 9, "max_tokens": 4}, "min_tokens", "'min_tokens' must be between 0 and max_tokens "
                                                                         "(4), got 9"),
    ({"repetition_penalty": 0}, "repetition_penalty", "'repetition_penalty' must be greater than 0 and at most 2, got 0.0"),
    ({"logit_bias": {"5": 300}}, "logit_bias", "'logit_bias' values must be between -100 and 100, got 300.0"),
    ({"logit_bias": {"100000": 1}}, "logit_bias", None),
    ({"stop_token_ids": [-1]}, "stop_token_ids", None),
    ({"n": 2, "best_of": 1}, "best_of", "'best_of' (1) must be at least 'n' (2)"),
    ({"best_of": 3, "stream": True}, "best_of", None),
    ({"stop": ["x" * 300]}, "stop", None),
    ({"logprobs": 21}, "logprobs", "'logprobs' must be an integer between 0 and 20, got 21"),
])
def test_bad_sampling_fields_are_a_400_naming_the_field(server, body, param, message):
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {TOKEN}"},
                   json={"model": "tiny", "prompt": PROMPT} | body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    if message:
        assert r.json()["error"]["message"] == message


def test_a_nan_sampling_parameter_is_a_400(server):
    raw = b'{"model": "tiny", "prompt": "the cat", "temperature": NaN}'
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {TOKEN}",
                                                            "Content-Type": "application/json"}, content=raw)
    assert r.status_code == 400 and "NaN" in r.text


def test_seeded_samples_are_the_same_after_a_restart(hf_dir, client):  # noqa: F811
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0.9, seed=1234, n=2)
    first = [c.text for c in client.completions.create(**kw).choices]
    with ServerThread(hf_dir["dir"], ServeOptions(name="tiny", token=TOKEN, block_size=16, kv_cache_mb=2)) as srv:
        again = openai.OpenAI(base_url=srv.url + "/v1", api_key=TOKEN, max_retries=0).completions.create(**kw)
    assert [c.text for c in again.choices] == first


def test_vllm_flags_map_onto_plaits_or_are_refused_naming_plaits(hf_dir, monkeypatch, capsys):  # noqa: F811
    from plait import cli
    from plait.serve import commands as server  # the verb runs plait.serve.commands.run

    seen = {}
    monkeypatch.setattr(server, "run", lambda path, opts: seen.update(path=path, opts=opts) or 0)
    d = str(hf_dir["dir"])
    assert cli.main(["serve", "--model", d, "--served-model-name", "m", "--max-model-len", "128",
                     "--tensor-parallel-size", "1", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
                     "--dtype", "float32", "--no-enable-prefix-caching", "--lora-modules", "a=/x"]) == 0
    o = seen["opts"]
    assert (seen["path"], o.name, o.max_model_len, o.tp, o.max_seqs, o.max_step_tokens) == (d, "m", 128, 1, 8, 64)
    assert o.prefix_caching is False and o.lora == ("a=/x",)
    for args, line in [
        (["--gpu-memory-utilization", "0.9"], "error: --gpu-memory-utilization is vLLM's and plait has no such setting; "
                                              "plait sizes the KV cache in megabytes: --kv-cache-mb MB"),
        (["--dtype", "bfloat16"], "error: --dtype bfloat16: plait serve runs float32 weights; leave --dtype out (or "
                                  "auto), or use --quantize int8 for smaller ones"),
        (["--trust-remote-code"], "error: --trust-remote-code is vLLM's and plait has no such setting; plait never "
                                  "imports a model directory's code; it builds Llama-family and GPT-2 models itself"),
    ]:
        assert cli.main(["serve", d, *args]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == line
    assert cli.main(["serve"]) == 2
    assert capsys.readouterr().err.strip() == ("error: give the model to serve: plait serve "
                                               "RUN_DIR|model.safetensors|HF_DIR (or --model DIR)")


def test_max_model_len_above_the_models_context_is_refused(hf_dir):  # noqa: F811
    from plait.serve.errors import ServeError
    from plait.serve.service import Service

    with pytest.raises(ServeError, match=r"^--max-model-len 300 exceeds the model's context of 256 positions; "
                                         r"give at most that$"):
        Service(str(hf_dir["dir"]), ServeOptions(max_model_len=300))
