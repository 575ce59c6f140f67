"""Tool calls on /v1/chat/completions (issue 55 item 5), with the official `openai` client: the tools rendered by the
chat template, the model's own calls parsed in the Hermes/Qwen format and in Llama 3.1's JSON (their text forced here
by a regex, since a random model never writes one), a named or required tool choice constrained to valid arguments,
each in the response and in the stream."""

from __future__ import annotations

import json

import pytest

from plait.serve.entrypoints.tool_calls import StreamParser, parse

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

HERMES = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
          "Answer with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>\n{% endif %}"
          "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
          "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
          "{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
LLAMA31 = ("{% if tools %}Environment: ipython\nGiven the following functions, respond with a JSON for a function call "
           "with its proper arguments.{% for t in tools %}{{ t | tojson }}{% endfor %}\n{% endif %}"
           "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
           "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                                "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "weather in Paris?"}]


def server_with(shared, template: str):
    """A server of a copy of the shared byte-level Llama with this chat template (the shared one stays as it is)."""
    import shutil
    import tempfile
    from pathlib import Path

    from plait.serve.entrypoints.server import ServerThread
    from plait.serve.service import ServeOptions

    d = Path(tempfile.mkdtemp(prefix="plait-tools-")) / "llama"
    shutil.copytree(shared, d)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": template}))
    return ServerThread(d, ServeOptions(name="m", block_size=16, kv_cache_mb=16, max_delay_ms=0))


@pytest.fixture(scope="module")
def hermes(byte_llama):  # noqa: F811
    with server_with(byte_llama, HERMES) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120), srv


def arguments(call, tool) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_a_named_tool_choice_gives_a_valid_call_whole_and_streamed(hermes):
    client, srv = hermes
    kw = dict(model="m", messages=ASK, tools=[WEATHER, TIME], max_tokens=60, temperature=1.0, seed=5,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = client.chat.completions.create(**kw)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content is None and len(m.tool_calls) == 1
    call = m.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    streamed = [c.choices[0] for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    deltas = [d for c in streamed for d in (c.delta.tool_calls or [])]
    assert [(d.index, d.function.name) for d in deltas] == [(0, "get_weather")]
    assert json.loads(deltas[0].function.arguments) == arguments(call, WEATHER)  # same seed, same call
    assert streamed[-1].finish_reason == "tool_calls" and not "".join(c.delta.content or "" for c in streamed)
    rendered = srv.service.served.chat.render(ASK, add_generation_prompt=True, tools=[WEATHER, TIME])
    assert r.usage.prompt_tokens == len(srv.service.served.tokenizer.encode(rendered))  # the tools were rendered


def test_required_calls_are_each_one_of_the_tools(hermes):
    client, _ = hermes
    r = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       max_tokens=200, temperature=1.0, n=6, seed=1)
    tools = {"get_weather": WEATHER, "get_time": TIME}
    ended = [c for c in r.choices if c.finish_reason == "tool_calls"]  # a list of calls has no bound: some run long
    assert len(ended) >= 3 and all(c.finish_reason == "length" for c in r.choices if c not in ended)
    for choice in ended:
        for call in choice.message.tool_calls:
            arguments(call, tools[call.function.name])
    one = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=120, temperature=1.0, n=4, seed=2)
    assert all(len(c.message.tool_calls) == 1 for c in one.choices)


def test_the_models_own_hermes_calls_are_parsed_whole_and_streamed(hermes):
    client, _ = hermes
    forced = (r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}'
              r'</tool_call>')
    kw = dict(model="m", messages=ASK, tools=[WEATHER], max_tokens=80, temperature=1.0, seed=3,
              extra_body={"guided_regex": forced})
    r = client.chat.completions.create(**kw)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content == "Sure."
    assert arguments(m.tool_calls[0], WEATHER)
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    assert "".join(c.delta.content or "" for c in chunks).strip() == "Sure."  # no piece of the call leaked as content
    deltas = [d for c in chunks for d in (c.delta.tool_calls or [])]
    assert [json.loads(d.function.arguments) for d in deltas] == [json.loads(m.tool_calls[0].function.arguments)]
    plain = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], max_tokens=10, temperature=0)
    assert plain.choices[0].message.tool_calls is None  # a reply that calls nothing is content


def test_llama31_json_calls_are_parsed(byte_llama):  # noqa: F811
    forced = r'\{"name": "get_weather", "parameters": \{"city": "Rome", "days": 2\}\}'
    with server_with(byte_llama, LLAMA31) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], max_tokens=60, temperature=1.0,
                                           extra_body={"guided_regex": forced})
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Rome", "days": 2})


def test_tool_choice_errors_name_the_field(hermes, byte_llama):  # noqa: F811
    client, _ = hermes
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice"
    assert e.value.body["message"] == "'tool_choice' names a function that is not in 'tools' (get_weather)"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=ASK, tools=[{"type": "function"}])
    assert e.value.body["param"] == "tools"


@pytest.mark.parametrize("text, style, content, calls", [
    ('I will check. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call><tool_call>{"name": "g", '
     '"arguments": {}}</tool_call>', "hermes", "I will check.", [("f", {"a": 1}), ("g", {})]),
    ('<tool_call>{broken</tool_call> hi', "hermes", '<tool_call>{broken</tool_call> hi', []),
    ('<|python_tag|>{"name": "f", "parameters": {"x": "y"}}; {"name": "g", "parameters": {}}', "llama3_json", None,
     [("f", {"x": "y"}), ("g", {})]),
    ('Hello {not a call', "llama3_json", 'Hello {not a call', []),
])
def test_the_parsers_whole_and_in_pieces(text, style, content, calls):
    got_content, got = parse(text, style)
    assert got_content == content and [(c.name, json.loads(c.arguments)) for c in got] == calls
    for size in (1, 3, 7):
        p, sent, found = StreamParser(style), "", []
        for i in range(0, len(text), size):
            piece, new = p.feed(text[i:i + size])
            sent, found = sent + piece, found + new
        piece, new = p.finish()
        sent, found = sent + piece, found + new
        assert [(c.name, json.loads(c.arguments)) for c in found] == calls
        assert sent.strip() == (content or "").strip() if calls else sent == text
