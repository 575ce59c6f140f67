"""Structured output (issue 55 item 4): response_format json_schema / json_object, vLLM's regex and choice, applied as a
token mask in the sampler for every sequence of a batch. A random Llama with a byte-level tokenizer samples at
temperature 1: without the mask its text is noise, with it every one of 112 outputs parses and validates."""

from __future__ import annotations

import json
import re

import pytest

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


def test_a_grammar_ref_pickles_and_compiles_in_another_process(byte_llama):
    """--replicas: the request's GrammarRef crosses the pipe (its kind and spec, a few hundred bytes); a replica that
    registered its model's grammars compiles it there (fleet.replica_worker does at start; the pool sends a
    picklable grammar to a replica: tests/serve/test_serve_replica_engine.py)."""
    import pickle
    import subprocess
    import sys

    from plait.data.hf_tokenizer import HFTokenizer
    from plait.serve.engine.grammar import GrammarRef, Grammars

    tok = HFTokenizer.from_file(byte_llama / "tokenizer.json")
    eos = frozenset({tok.tokenizer.token_to_id("</s>")})
    ref = Grammars.of_model(tok.to_json(), tok.vocab_size, eos).factory("choice", ["left", "right"])
    blob = pickle.dumps(ref)
    assert isinstance(ref, GrammarRef) and len(blob) < 300
    code = ("import pickle, sys, torch; from plait.data.hf_tokenizer import HFTokenizer; "
            "from plait.serve.engine.grammar import Grammars; "
            f"tok = HFTokenizer.from_file({str(byte_llama / 'tokenizer.json')!r}); "
            f"Grammars.of_model(tok.to_json(), tok.vocab_size, frozenset({sorted(eos)!r})); "
            "m = pickle.loads(sys.stdin.buffer.read())(); ok = m.allowed(tok.vocab_size); "
            "print(sorted(tok.decode([int(i)]) for i in ok.nonzero()))")
    out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, check=True).stdout.decode()
    allowed = eval(out)  # noqa: S307 -- the list our own subprocess printed
    assert allowed and all("left".startswith(t) or "right".startswith(t) for t in allowed)


def test_one_batch_of_masks_is_each_sequences_own_mask(byte_llama):
    """The engine's step asks llguidance for all its sequences' next masks in one call (MaskBatch, on the mask thread
    during the forward) and masks their logits rows at once: each row as its own grammar's mask leaves it, for
    matchers at different points of the schema and logits wider than the tokenizer's vocabulary."""
    import torch
    from tokenizers import Tokenizer

    from plait.serve.engine.grammar import Grammars
    from plait.serve.engine.sampling import MaskBatch, Processors, SamplingParams

    tok = Tokenizer.from_file(str(byte_llama / "tokenizer.json"))
    width = tok.get_vocab_size() + 50  # the model's logits: more rows than the tokenizer has tokens
    ref = Grammars.of_model(tok.to_str(), width, frozenset({tok.token_to_id("</s>")})).factory("json_schema", SCHEMA)
    procs = [Processors(SamplingParams(grammar=ref), [1], width) for _ in range(4)]
    g = torch.Generator().manual_seed(0)
    for i, p in enumerate(procs):  # sequence i has taken 2 i tokens of the schema
        for _ in range(1 + 2 * i):
            scores = p(torch.randn(width, generator=g))
            p.accept(int(scores.argmax()))
    batch = MaskBatch.start(procs)
    assert batch is not None and batch.procs == procs
    rows = torch.randn(6, width, generator=g)
    idx = [4, 0, 5, 2]  # procs[i]'s row is rows[idx[i]]; rows 1 and 3 are other sequences'
    got = batch.apply(rows.clone(), idx)
    for i, p in enumerate(procs):
        want = rows[idx[i]].masked_fill(~p.grammar.allowed(width), float("-inf"))
        assert torch.equal(got[idx[i]], want), i
        assert torch.equal(p(got[idx[i]], masked=True), want)  # masked=True: the grammar's part is left out
    assert torch.equal(got[[1, 3]], rows[[1, 3]])
    assert len({tuple(torch.isfinite(got[r]).nonzero().flatten().tolist()) for r in idx}) > 1  # the states differ


def test_a_held_token_the_grammar_refuses_fails_that_sequence_alone(byte_llama):
    """The token a step draws is held and consumed by the next MaskBatch, on the mask thread; one its grammar refuses
    (a bug elsewhere: drawn tokens come from the masked logits) makes the batch's apply raise, leaves the rows as they
    were, and names the token in that sequence's own mask, while the others' tokens were consumed."""
    import torch
    from tokenizers import Tokenizer

    from plait.serve.engine.grammar import Grammars
    from plait.serve.engine.sampling import MaskBatch, Processors, SamplingParams

    tok = Tokenizer.from_file(str(byte_llama / "tokenizer.json"))
    width = tok.get_vocab_size()
    ref = Grammars.of_model(tok.to_str(), width, frozenset({tok.token_to_id("</s>")})).factory("json_schema", SCHEMA)
    good, bad, fresh = (Processors(SamplingParams(grammar=ref), [1], width) for _ in range(3))
    start = good(torch.zeros(width))
    first, letter = int(start.argmax()), tok.token_to_id("x")  # an allowed token ('{"'), a refused one
    assert start[first] == 0 and start[letter] == float("-inf") and torch.equal(bad(torch.zeros(width)), start)
    good.accept(first)
    bad.accept(letter)  # held, not yet consumed
    assert good.grammar.held == [first] and bad.grammar.held == [letter]
    batch = MaskBatch.start([good, bad])
    rows = torch.zeros(2, width)
    with pytest.raises(ValueError, match="a grammar refused the token drawn"):
        batch.apply(rows)
    assert torch.equal(rows, torch.zeros(2, width))
    with pytest.raises(ValueError, match=rf"^the grammar refused token {letter}: "):
        bad(torch.zeros(width))
    assert not bad.batchable()
    fresh.grammar.accept(first)  # consumed here, at once
    after = good(torch.zeros(width))  # consumed on the mask thread
    assert torch.equal(after, fresh(torch.zeros(width))) and not torch.equal(after, start)
