"""Structured output (issue 55 item 4): response_format json_schema / json_object, vLLM's regex and choice, applied as a
token mask in the sampler for every sequence of a batch. A random Llama with a byte-level tokenizer samples at
temperature 1: without the mask its text is noise, with it every one of 112 outputs parses and validates."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("transformers")

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
    "ok": {"type": "boolean"}},
    "required": ["name", "age", "tags", "ok"], "additionalProperties": False}


DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"


@pytest.fixture(scope="module")
def byte_llama(tmp_path_factory):
    """A LlamaForCausalLM with random weights and a byte-level BPE tokenizer (every string is some tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("bytes") / "llama"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    text = '{"name": "ann", "age": 31, "tags": ["red"], "ok": true} the cat sat on the mat 2024-05-17 ' * 40
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=320, special_tokens=["</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      eos_token_id=tok.token_to_id("</s>"), bos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)
    model.save_pretrained(d)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return d


@pytest.fixture(scope="module")
def client(byte_llama):
    from plait.serve.entrypoints.server import ServerThread
    from plait.serve.service import ServeOptions

    with ServerThread(byte_llama, ServeOptions(name="m", block_size=16, kv_cache_mb=8, max_delay_ms=0)) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_112_sampled_outputs_all_validate_against_the_schema(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    outputs = []
    for seed in range(7):
        r = client.completions.create(model="m", prompt="person:", max_tokens=120, temperature=1.0, n=16, seed=seed,
                                      extra_body={"response_format": fmt})
        outputs += [(c.text, c.finish_reason) for c in r.choices]
    assert len(outputs) == 112
    for text, reason in outputs:
        jsonschema.validate(json.loads(text), SCHEMA)
        assert reason == "stop"
    free = client.completions.create(model="m", prompt="person:", max_tokens=40, temperature=1.0, seed=0)
    with pytest.raises(ValueError):  # the same model unconstrained: not JSON
        json.loads(free.choices[0].text)


def test_a_streamed_chat_with_a_schema_and_json_object(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    chunks = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "json please"}],
                                            max_tokens=120, temperature=1.0, seed=3, n=4, stream=True,
                                            response_format=fmt)
    texts = ["", "", "", ""]
    for c in chunks:
        if c.choices:
            texts[c.choices[0].index] += c.choices[0].delta.content or ""
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    # any JSON object: unbounded, so a random model may run out of tokens; each one that ends is a JSON object
    r = client.completions.create(model="m", prompt="json please", max_tokens=300, temperature=1.0, seed=3, n=8,
                                  extra_body={"response_format": {"type": "json_object"}})
    ended = [c.text for c in r.choices if c.finish_reason == "stop"]
    assert len(ended) >= 4 and all(isinstance(json.loads(t), dict) for t in ended)
    assert all(c.text.startswith("{") for c in r.choices)


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"regex": DATE}}, lambda t: re.fullmatch(DATE, t)),
    ({"guided_regex": r"(cat|dog)s? (sat|ran)"}, lambda t: re.fullmatch(r"(cat|dog)s? (sat|ran)", t)),
    ({"structured_outputs": {"choice": ["yes", "no", "maybe later"]}}, lambda t: t in ("yes", "no", "maybe later")),
    ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
])
def test_regex_and_choice(client, extra, check):
    r = client.completions.create(model="m", prompt="answer:", max_tokens=40, temperature=1.0, n=8, seed=1,
                                  extra_body=extra)
    assert all(check(c.text) and c.finish_reason == "stop" for c in r.choices), [c.text for c in r.choices]


def test_a_schema_that_does_not_compile_is_a_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt="x", extra_body={"guided_regex": "(unclosed"})
    assert e.value.body["param"] == "guided_regex"
    assert e.value.body["message"].startswith("the regex does not compile: ")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt="x", extra_body={"guided_regex": "a", "guided_choice": ["b"]})
    assert e.value.body["message"] == "'guided_regex' and 'guided_choice' both constrain the output; give one"


def test_a_grammar_crosses_to_a_replica_and_compiles_there(byte_llama):
    """--replicas 2: the request's GrammarRef pickles (its kind and spec), each replica compiles it once for its own
    engine, and the server builds no engine of its own for it."""
    import pickle

    from plait.serve.engine.grammar import GrammarRef, Grammars
    from plait.serve.entrypoints.server import ServerThread
    from plait.serve.service import ServeOptions

    opts = ServeOptions(name="m", replicas=2, block_size=16, kv_cache_mb=8, max_delay_ms=0)
    with ServerThread(byte_llama, opts) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        r = client.completions.create(model="m", prompt="answer:", max_tokens=20, temperature=1.0, n=4, seed=1,
                                      extra_body={"guided_choice": ["left", "right"]})
        assert srv.service._grammar_engine is None
    assert all(c.text in ("left", "right") and c.finish_reason == "stop" for c in r.choices)
    tok = srv.service.served.tokenizer
    ref = Grammars.of_model(tok.to_json(), srv.service.served.vocab_size, srv.service.served.eos_ids).factory(
        "regex", "[ab]+")
    assert isinstance(ref, GrammarRef) and len(pickle.dumps(ref)) < 300
