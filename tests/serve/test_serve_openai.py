"""The OpenAI-compatible endpoints, driven by the official `openai` client, on a tiny Hugging Face Llama directory:
greedy text equal to transformers' generate, streamed equal to not streamed, chat through the model's template,
stop strings, n and seeds, logprobs equal to the model's, errors in OpenAI's shape."""


import httpx
import pytest
import torch

from plait.serve.entrypoints.server import ServerThread, banner_lines
from plait.serve.service import ServeOptions

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

CORPUS = ("the cat sat on the mat and the dog ran to the park where a bird sang in the tree "
          "while children played with a red ball near the old stone wall ") * 30
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TOKEN = "sk-test-0123"


@pytest.fixture(scope="module")
def server(hf_dir):
    with ServerThread(hf_dir["dir"], ServeOptions(name="tiny", token=TOKEN, block_size=8, kv_cache_mb=4)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=TOKEN, max_retries=0, timeout=60)


def hf_greedy(hf_dir, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf_dir["model"].generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                       eos_token_id=hf_dir["eos"], pad_token_id=hf_dir["eos"])
    return out[0, len(ids):].tolist()


def decode(hf_dir, ids: list[int]) -> str:
    return hf_dir["tok"].decode(ids, skip_special_tokens=False)


PROMPT = "the dog ran to the"


def test_models_and_greedy_completion_equal_transformers(client, hf_dir):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    ids = hf_dir["tok"].encode(PROMPT, add_special_tokens=False).ids
    want = hf_greedy(hf_dir, ids, 12)
    assert r.choices[0].text == decode(hf_dir, [t for t in want if t != hf_dir["eos"]])
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want)
    assert r.usage.total_tokens == len(ids) + len(want)
    assert r.choices[0].finish_reason == ("stop" if want[-1] == hf_dir["eos"] else "length")
    assert r.object == "text_completion" and r.model == "tiny" and r.id.startswith("cmpl-")


def test_a_generate_prompt_longer_than_the_context_in_characters_is_tokenized_whole(server, hf_dir):
    # 256 positions; this prompt has about 4 x 256 characters but fewer tokens than that: a cut at 256 characters
    # (right for a character tokenizer) would hand the model a third of it, starting mid-word.
    prompt = " ".join(CORPUS.split()[:190])
    ids = hf_dir["tok"].encode(prompt, add_special_tokens=False).ids
    assert len(prompt) > 3 * 256 and len(ids) + 8 < 256
    r = httpx.post(server.url + "/v1/generate", json={"prompt": prompt, "max_new_tokens": 8, "temperature": 0},
                   headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == hf_greedy(hf_dir, ids, 8)


def test_streamed_completion_equals_the_whole_one(client):
    whole = client.completions.create(model="tiny", prompt=[PROMPT, "a bird"], max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt=[PROMPT, "a bird"], max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    for i in range(2):
        text = "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
        assert text == whole.choices[i].text
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].index == i]
        assert reasons[-1] == whole.choices[i].finish_reason and set(reasons[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_uses_the_template_and_streams(client, hf_dir):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages) + "<|assistant|>"
    want = hf_greedy(hf_dir, hf_dir["tok"].encode(text, add_special_tokens=False).ids, 8)
    assert r.choices[0].message.content == decode(hf_dir, [t for t in want if t != hf_dir["eos"]])
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
    stream = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == r.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_stop_strings_cut_the_text_and_are_never_streamed(client):
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    cut = full[:full.find(stop)]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "zzz"])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True) if c.choices)
    assert streamed == cut


def test_n_choices_with_a_seed_are_reproducible_and_differ(client):
    kw = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "seed": 11, "n": 3}
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    texts = [c.text for c in a.choices]
    assert texts == [c.text for c in b.choices] and len(set(texts)) > 1
    assert [c.index for c in a.choices] == [0, 1, 2]


def test_logprobs_are_the_models(client, hf_dir):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    ids = hf_dir["tok"].encode(PROMPT, add_special_tokens=False).ids
    want = hf_greedy(hf_dir, ids, 5)
    with torch.no_grad():
        logits = hf_dir["model"](torch.tensor([ids + want])).logits[0, len(ids) - 1:-1]
    ref = torch.log_softmax(logits, -1)
    assert lp.token_logprobs == pytest.approx([float(ref[i, t]) for i, t in enumerate(want)], abs=1e-4)
    assert [len(t) for t in lp.top_logprobs] == [2] * len(want)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)


def test_errors_have_openais_shape(server, client, hf_dir):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x")
    assert e.value.body["message"] == "the model 'gpt-4' does not exist; this server serves: tiny"
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", temperature=3)
    assert e.value.body == {"message": "'temperature' must be a number between 0 and 2, got 3",
                            "type": "invalid_request_error", "param": "temperature", "code": None}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", presence_penalty=2.5)
    assert e.value.body["message"] == "'presence_penalty' must be between -2 and 2, got 2.5"
    assert e.value.body["param"] == "presence_penalty"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=5000)
    n = len(hf_dir["tok"].encode("x", add_special_tokens=False).ids)
    assert e.value.body["message"] == (f"this model's maximum context length is 256 tokens; you requested {n + 5000} "
                                       f"({n} in the prompt, 5000 in the completion): lower 'max_tokens' to at most "
                                       f"{256 - n}")
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert e.value.body["code"] == "invalid_api_key"
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {TOKEN}"},
                   json={"model": "tiny", "prompt": "x", "best_of": 2, "temperature": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
    metrics = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    assert "plait_time_to_first_token_seconds_count" in metrics and "plait_kv_blocks_used 0.0" in metrics


def test_a_draft_model_speculates_and_the_text_stays_the_targets(hf_dir, tmp_path):
    """--draft: a one-layer Llama of the same tokenizer proposes 3 tokens a step; greedy text is transformers'."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from plait.serve.errors import ServeError
    from plait.serve.service import Service

    vocab = hf_dir["tok"].get_vocab_size()
    torch.manual_seed(1)
    small = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256))
    small.save_pretrained(tmp_path / "draft")
    hf_dir["tok"].save(str(tmp_path / "draft" / "tokenizer.json"))
    opts = ServeOptions(name="tiny", draft=str(tmp_path / "draft"), num_speculative_tokens=3, block_size=8, kv_cache_mb=4)
    with ServerThread(hf_dir["dir"], opts) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        for prompt in (PROMPT, "a bird sang in the tree", "the"):
            r = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
            want = hf_greedy(hf_dir, hf_dir["tok"].encode(prompt, add_special_tokens=False).ids, 16)
            assert r.choices[0].text == decode(hf_dir, [t for t in want if t != hf_dir["eos"]])
        metrics = httpx.get(srv.url + "/metrics").text
        banner = banner_lines(srv.service, srv.url)
    assert f" · draft {tmp_path / 'draft'} (3 tokens a step)" in banner[1]  # the engine's settings, not the batcher's
    rate = [line for line in metrics.splitlines() if line.startswith("plait_speculative_acceptance_rate ")]
    assert rate and 0.0 <= float(rate[0].split()[1]) <= 1.0
    LlamaForCausalLM(LlamaConfig(vocab_size=vocab + 8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path / "wide")
    hf_dir["tok"].save(str(tmp_path / "wide" / "tokenizer.json"))
    with pytest.raises(ServeError) as e:
        Service(str(hf_dir["dir"]), ServeOptions(draft=str(tmp_path / "wide")))
    assert str(e.value) == (f"--draft {tmp_path / 'wide'} has a vocabulary of {vocab + 8} tokens and the served model "
                            f"{vocab}: a draft must share the served model's tokenizer")


def test_lora_adapters_answer_by_model_name_in_one_batch(hf_dir, tmp_path):
    """--lora sql=FILE --lora chat=FILE: each request's model picks its adapter; the text is that adapter's merged
    model's (plait's llama with W + scale B A), and the base model still answers under its own name."""
    import asyncio

    from plait.models.hf import load_hf_model
    from serve.test_engine import adapter_file, merged_copy

    _, _, plait_model, _ = load_hf_model(hf_dir["dir"])
    plait_model.eval()
    files = {"sql": adapter_file(plait_model, tmp_path / "sql.safetensors", ["blocks.0.attn.q_proj", "blocks.1.mlp.up_proj"],
                                 4, 64.0, 1),
             "chat": adapter_file(plait_model, tmp_path / "chat.safetensors",
                                  ["blocks.1.attn.o_proj", "blocks.0.mlp.gate_proj", "head"], 2, 32.0, 2)}
    refs = {"tiny": plait_model, "sql": merged_copy(plait_model, files["sql"], 16.0),
            "chat": merged_copy(plait_model, files["chat"], 16.0)}
    ids = hf_dir["tok"].encode(PROMPT, add_special_tokens=False).ids
    want = {}
    for name, model in refs.items():
        out = model.generate(torch.tensor([ids]), 10, temperature=0)[0, len(ids):].tolist()
        cut = out.index(hf_dir["eos"]) + 1 if hf_dir["eos"] in out else len(out)
        want[name] = decode(hf_dir, [t for t in out[:cut] if t != hf_dir["eos"]])
    assert len(set(want.values())) == 3, want
    opts = ServeOptions(name="tiny", lora=(f"sql={tmp_path / 'sql.safetensors'}", f"chat={tmp_path / 'chat.safetensors'}"),
                        block_size=8, kv_cache_mb=4, max_delay_ms=0)
    with ServerThread(hf_dir["dir"], opts) as srv:
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)

        async def all_at_once():
            return await asyncio.gather(*(client.completions.create(model=m, prompt=PROMPT, max_tokens=10, temperature=0)
                                          for m in ("sql", "tiny", "chat", "sql")))

        got = asyncio.run(all_at_once())
        listed = [m.id for m in openai.OpenAI(base_url=srv.url + "/v1", api_key="none").models.list().data]
        unknown = httpx.post(srv.url + "/v1/completions", json={"model": "sql2", "prompt": "a"})
        banner = banner_lines(srv.service, srv.url)
    assert banner[1].endswith(" · LoRA adapters: sql, chat") and "batching: max" not in "".join(banner)
    assert [r.choices[0].text for r in got] == [want["sql"], want["tiny"], want["chat"], want["sql"]]
    assert [r.model for r in got] == ["sql", "tiny", "chat", "sql"] and listed == ["tiny", "sql", "chat"]
    assert unknown.status_code == 404
    assert unknown.json()["error"]["message"] == "the model 'sql2' does not exist; this server serves: tiny, sql, chat"


def test_streamed_text_decodes_only_the_new_tokens_and_adds_up_to_the_whole():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from plait.data.hf_tokenizer import HFTokenizer
    from plait.serve.entrypoints.openai_text import Text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    sample = "naïve café, 日本語 and emoji 🙂 stay whole: the cat sat. " * 4
    tok.train_from_iterator([sample], trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = HFTokenizer(tok)
    ids = tok.encode(sample).ids
    calls = []

    class Counting:
        def decode(self, xs):
            calls.append(len(xs))
            return hf.decode(xs)

    text = Text(Counting().decode, stops=[])
    out = "".join(text.add(i) for i in ids) + text.flush()
    assert out == hf.decode(ids) == sample
    assert "\ufffd" not in out and max(calls) < 12  # a few tokens at a time, never the whole sequence
    stopped = Text(hf.decode, stops=["sat."])
    said = "".join(stopped.add(i) for i in ids[:40]) + stopped.flush()
    assert stopped.stopped and said == sample[:sample.index("sat.")]
