"""An OpenAI (or vLLM) request body as one engine request: its prompts' tokens and one SamplingParams.

The fields of /v1/completions and /v1/chat/completions, with vLLM's extensions (repetition_penalty, min_tokens,
ignore_eos, stop_token_ids, skip_special_tokens, return_tokens_as_token_ids), are read here; the engine's
SamplingParams.validate checks the ranges. Anything else is a 400 naming the field.

Token budgets are bounded by the model's context (--max-model-len, else the model's own): the prompt and
max_tokens together must fit it, and a request that does not give max_tokens gets 16 (completions, OpenAI's
default) or what is left of the context (chat, vLLM's).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from dataclasses import dataclass, field

from plait.serve.engine.sampling import InvalidParam, SamplingParams
from plait.serve.entrypoints.tool_calls import forced_schema, style_of
from plait.serve.errors import RequestError
from plait.serve.service import MIN_TEMPERATURE, SURROGATE, Service

MAX_N = 16  # choices (n, best_of) of one request at most
MAX_LOGPROBS = 20  # top log-probabilities per token at most (vLLM's --max-logprobs default)
MAX_STOPS, MAX_STOP_CHARS = 16, 256  # stop strings per request, characters per stop string
MAX_MESSAGES, MAX_MESSAGE_CHARS = 1024, 1 << 20
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "stream_options",
          "user", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos",
          "stop_token_ids", "logit_bias", "skip_special_tokens", "return_tokens_as_token_ids", "response_format",
          "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "best_of"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"}
MAX_TOOLS = 128
PLAIN_TEMPLATE = "{role}: {content}\n"


class BadField(RequestError):
    def __init__(self, param: str, message: str, status: int = 400):
        super().__init__(status, message)
        self.param = param


@dataclass
class Ask:
    """One parsed request: its prompts' tokens, sampling, stop strings, choices, and how to answer."""

    body: dict
    prompts: list[list[int]]
    params: SamplingParams
    stops: list[str]
    n: int
    stream: bool
    chat: bool
    adapter: int
    best_of: int = 1  # candidates per prompt; the n with the highest mean log-probability are answered
    echo: bool = False  # completions: the prompt before the text (and its log-probabilities)
    skip_special: bool = True  # special tokens (</s>) are left out of the text (vLLM's skip_special_tokens)
    ids_as_tokens: bool = False  # logprobs' tokens as "token_id:N" (vLLM's return_tokens_as_token_ids)
    extra: dict = field(default_factory=dict)  # what a feature adds (tools, response_format)


def _number(body: dict, key: str, default, low: float, high: float, integer: bool = False):
    v = body.get(key, default)
    if v is None:
        return default
    kind = int if integer else (int, float)
    if not isinstance(v, kind) or isinstance(v, bool) or not low <= v <= high:
        what = "an integer" if integer else "a number"
        raise BadField(key, f"'{key}' must be {what} between {low:g} and {high:g}, got {json.dumps(v)[:40]}")
    return v


def _flag(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadField(key, f"'{key}' must be true or false")
    return v


def _token_ids(body: dict, key: str, vocab: int, most: int) -> list[int]:
    v = body.get(key) or []
    if not (isinstance(v, list) and len(v) <= most
            and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in v)):
        raise BadField(key, f"'{key}' must be a list of at most {most} token ids in [0, {vocab})")
    return v


def _logit_bias(body: dict, vocab: int) -> tuple[tuple[int, float], ...]:
    v = body.get("logit_bias") or {}
    if not isinstance(v, dict) or len(v) > 1024:
        raise BadField("logit_bias", "'logit_bias' must be an object of at most 1024 {\"token id\": bias} entries")
    out = []
    for key, bias in v.items():
        try:
            token = int(key)
        except ValueError:
            raise BadField("logit_bias", f"'logit_bias' keys are token ids, got {key[:20]!r}") from None
        if not isinstance(bias, (int, float)) or isinstance(bias, bool):
            raise BadField("logit_bias", f"'logit_bias' values are numbers between -100 and 100, got {bias!r}")
        out.append((token, float(bias)))
    return tuple(out)


def max_model_len(service: Service) -> int:
    """The most tokens, prompt and output, one sequence may hold: --max-model-len, else the model's context."""
    return service.opts.max_model_len or service.served.context


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if (not isinstance(stops, list) or len(stops) > MAX_STOPS
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)):
        raise BadField("stop", f"'stop' must be a non-empty string or a list of at most {MAX_STOPS} of them, each at "
                               f"most {MAX_STOP_CHARS} characters")
    return stops


def _logprobs(body: dict, chat: bool) -> int | None:
    if not chat:
        return _number(body, "logprobs", None, 0, MAX_LOGPROBS, integer=True)
    want = _flag(body, "logprobs", False)
    top = _number(body, "top_logprobs", 0, 0, MAX_LOGPROBS, integer=True)
    if top and not want:
        raise BadField("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    return top if want else None


def sampling(service: Service, body: dict, chat: bool, prompt_len: int) -> tuple[SamplingParams, dict]:
    """The request's SamplingParams (its max_tokens fitted to the longest prompt) and the answer's options."""
    fields = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = sorted(set(body) - fields)
    if unknown:
        raise BadField(unknown[0], f"unrecognized request argument: '{unknown[0][:64]}'; this endpoint takes "
                                   f"{', '.join(sorted(fields))}")
    context = max_model_len(service)
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    room = context - prompt_len
    if room < 1:
        raise BadField("messages" if chat else "prompt", f"this model's maximum context length is {context} tokens; "
                                                         f"the prompt has {prompt_len}, which leaves no room to generate")
    max_tokens = _number(body, key, room if chat else min(16, room), 1, 1 << 31, integer=True)
    if prompt_len + max_tokens > context:
        raise BadField(key, f"this model's maximum context length is {context} tokens; you requested "
                            f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} in the completion): "
                            f"lower '{key}' to at most {room}")
    temperature = float(_number(body, "temperature", 1.0, 0.0, 2.0))
    if 0 < temperature < MIN_TEMPERATURE:
        raise BadField("temperature", f"'temperature' must be 0 (greedy) or at least {MIN_TEMPERATURE}")
    top_k = _number(body, "top_k", None, -1, 1 << 31, integer=True)
    seed = _number(body, "seed", None, 0, (1 << 63) - 1, integer=True)
    vocab = service.served.vocab_size
    stop_ids = set(_token_ids(body, "stop_token_ids", vocab, 64))
    if not _flag(body, "ignore_eos", False):
        stop_ids |= set(service.served.eos_ids)
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_k=None if top_k in (-1, 0) else top_k,
        top_p=float(_number(body, "top_p", 1.0, -1e9, 1e9)), seed=secrets.randbits(62) if seed is None else seed,
        stop_ids=frozenset(stop_ids), logprobs=_logprobs(body, chat),
        presence_penalty=float(_number(body, "presence_penalty", 0.0, -1e9, 1e9)),
        frequency_penalty=float(_number(body, "frequency_penalty", 0.0, -1e9, 1e9)),
        repetition_penalty=float(_number(body, "repetition_penalty", 1.0, -1e9, 1e9)),
        min_tokens=_number(body, "min_tokens", 0, 0, 1 << 31, integer=True), logit_bias=_logit_bias(body, vocab))
    try:
        params.validate(vocab)
    except InvalidParam as e:
        raise BadField(e.param, str(e)) from None
    options = {"stops": _stops(body), "skip_special": _flag(body, "skip_special_tokens", True),
               "ids_as_tokens": _flag(body, "return_tokens_as_token_ids", False)}
    return params, options


def _encode(service: Service, text: str, param: str) -> list[int]:
    if len(text) > service.opts.max_prompt_chars:
        raise BadField(param, f"'{param}' has {len(text)} characters; the limit is {service.opts.max_prompt_chars} "
                              "(--max-prompt-chars)", 413)
    if SURROGATE.search(text):
        raise BadField(param, f"'{param}' holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not a character")
    assert service.served.tokenizer is not None
    ids = [int(i) for i in service.served.tokenizer.encode(text)]
    if not ids:
        raise BadField(param, f"'{param}' encodes to no tokens")
    return ids


def completion_prompts(service: Service, prompt) -> list[list[int]]:
    """`prompt`: a string, a list of strings, a list of token ids, or a list of lists of token ids."""
    vocab = service.served.vocab_size

    def ids(p) -> list[int]:
        if not p or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in p):
            raise BadField("prompt", f"a token-id prompt is a non-empty list of integers in [0, {vocab})")
        return list(p)

    if isinstance(prompt, list) and len(prompt) > MAX_N:
        if all(isinstance(p, (str, list)) for p in prompt):
            raise BadField("prompt", f"'prompt' holds {len(prompt)} prompts; send at most {MAX_N} per request")
    if isinstance(prompt, str):
        return [_encode(service, prompt, "prompt")]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [_encode(service, p, "prompt") for p in prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return [ids(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return [ids(p) for p in prompt]
    raise BadField("prompt", "'prompt' must be a string, a list of strings, or token ids")


def chat_messages(messages) -> list[dict]:
    """The messages as the template takes them: role and text content, plus a tool call's or result's fields."""
    if not isinstance(messages, list) or not messages:
        raise BadField("messages", "'messages' must be a non-empty list of {\"role\", \"content\"} objects")
    if len(messages) > MAX_MESSAGES:
        raise BadField("messages", f"'messages' holds {len(messages)} messages; send at most {MAX_MESSAGES}")
    plain = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise BadField(f"messages[{i}].content", "only text content parts ({\"type\": \"text\", \"text\": ...}) "
                                                         "are supported")
            content = "".join(p["text"] for p in content)
        if content is None and isinstance(m, dict) and m.get("tool_calls"):
            content = ""  # an assistant turn that only called tools
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(content, str)):
            raise BadField(f"messages[{i}]", f"messages[{i}] needs a string 'role' and a string (or text parts) 'content'")
        if len(content) > MAX_MESSAGE_CHARS:
            raise BadField(f"messages[{i}].content", f"messages[{i}] has {len(content)} characters; the limit is "
                                                     f"{MAX_MESSAGE_CHARS}", 413)
        plain.append({"role": m["role"], "content": content}
                     | {k: m[k] for k in ("tool_calls", "tool_call_id", "name") if k in m})
    return plain


def chat_prompt(service: Service, messages, **template_vars) -> list[int]:
    plain = chat_messages(messages)
    template = service.served.chat
    if template is not None:
        try:
            text = template.render(plain, add_generation_prompt=True, **template_vars)
        except Exception as e:  # the template's own raise_exception (an unsupported role order, say)
            raise BadField("messages", f"the model's chat template refused the conversation: {e}") from None
    else:
        text = "".join(PLAIN_TEMPLATE.format(role=m["role"], content=m["content"]) for m in plain) + "assistant:"
    return _encode(service, text, "messages")


def structured(body: dict) -> tuple[str, str, object] | None:
    """(the field, the grammar's kind, its spec) of the request's structured output, or None: OpenAI's
    response_format, vLLM's structured_outputs, or its older guided_json / guided_regex / guided_choice /
    guided_grammar. One of them at most."""
    given = [k for k in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                         "guided_grammar") if body.get(k) is not None]
    if not given or given == ["response_format"] and body["response_format"] == {"type": "text"}:
        return None
    if len(given) > 1:
        raise BadField(given[1], f"'{given[0]}' and '{given[1]}' both constrain the output; give one")
    field, value = given[0], body[given[0]]
    if field == "response_format":
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "json_object":
            return field, "json_object", None
        schema = (value.get("json_schema") or {}).get("schema") if kind == "json_schema" else None
        if not isinstance(schema, dict):
            raise BadField(field, "'response_format' is {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                                  "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}")
        return field, "json_schema", schema
    if field == "structured_outputs":
        if not isinstance(value, dict) or len(value) != 1:
            raise BadField(field, "'structured_outputs' holds one of json, regex, choice or grammar")
        (key, value), = value.items()
    else:
        key = field.removeprefix("guided_")
    kinds = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark"}
    ok = {"json": lambda v: isinstance(v, (dict, str)), "regex": lambda v: isinstance(v, str),
          "choice": lambda v: isinstance(v, list) and v and all(isinstance(c, str) for c in v),
          "grammar": lambda v: isinstance(v, str)}
    if key not in kinds or not ok[key](value):
        raise BadField(field, f"'{field}': json takes a JSON schema, regex a string, choice a list of strings, grammar a "
                              "Lark grammar's text")
    if key == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise BadField(field, f"'{field}' is not a JSON schema (not JSON)") from None
    return field, kinds[key], value


def tools_of(service: Service, body: dict) -> dict | None:
    """{"tools", "mode"} of a chat request that offers tools (tool_choice not "none"), else None. mode: ("auto", the
    chat template's tool-call format), ("named", function) or ("required",) (plait.serve.entrypoints.tool_calls)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise BadField("tool_choice", "'tool_choice' needs 'tools'")
        return None
    ok = isinstance(tools, list) and len(tools) <= MAX_TOOLS and all(
        isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str) and isinstance(t["function"].get("parameters", {}), dict)
        for t in tools)
    if not ok:
        raise BadField("tools", f"'tools' is a list of at most {MAX_TOOLS} {{\"type\": \"function\", \"function\": "
                                "{\"name\": ..., \"parameters\": {...}}} objects")
    names = [t["function"]["name"] for t in tools]
    choice = "auto" if choice is None else choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            raise BadField("tool_choice", f"'tool_choice' names a function that is not in 'tools' ({', '.join(names)})")
        return {"tools": tools, "mode": ("named", name)}
    if choice == "none":
        return None
    if choice == "required":
        return {"tools": tools, "mode": ("required",)}
    if choice != "auto":
        raise BadField("tool_choice", "'tool_choice' is \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                                      "\"function\": {\"name\": ...}}")
    style = style_of(service.served.chat.source if service.served.chat is not None else None)
    if style is None:
        raise BadField("tool_choice", "this model's chat template shows no tool-call format, so the model's own calls "
                                      "cannot be read: use tool_choice \"required\" or name a function (plait then "
                                      "constrains the reply to a call)")
    return {"tools": tools, "mode": ("auto", style)}


def _with_grammar(params: SamplingParams, body: dict, grammars, tools: dict | None = None) -> SamplingParams:
    wanted = structured(body)
    if tools is not None and tools["mode"][0] != "auto":
        if wanted is not None:
            raise BadField(wanted[0], f"'{wanted[0]}' and 'tool_choice' both constrain the output; give one")
        mode = tools["mode"]
        parallel = body.get("parallel_tool_calls") is not False
        wanted = ("tool_choice", "json_schema", forced_schema(tools["tools"], mode[1] if mode[0] == "named"
                                                              else "required", parallel))
    if wanted is None:
        return params
    field, kind, spec = wanted
    if grammars is None:
        raise BadField(field, "structured output needs a model with a Hugging Face tokenizer (tokenizer.json)")
    try:
        return dataclasses.replace(params, grammar=grammars.factory(kind, spec))
    except ValueError as e:  # GrammarError: the schema or regex does not compile, or llguidance is missing
        raise BadField(field, str(e)) from None


def parse(service: Service, body: dict, chat: bool, adapter: int, grammars=None) -> Ask:
    """The Ask of a decoded body (BadField naming what is wrong); `grammars` compiles structured output's grammars
    (plait.serve.engine.grammar.Grammars; None for a model without a Hugging Face tokenizer)."""
    extra: dict = {"tools": tools_of(service, body)} if chat else {}
    offered = {"tools": extra["tools"]["tools"]} if extra.get("tools") else {}
    prompts = ([chat_prompt(service, body.get("messages"), **offered)] if chat
               else completion_prompts(service, body.get("prompt")))
    params, options = sampling(service, body, chat, max(len(p) for p in prompts))
    params = _with_grammar(params, body, grammars, extra.get("tools"))
    n = _number(body, "n", 1, 1, MAX_N, integer=True)
    best_of = n if chat else _number(body, "best_of", n, 1, MAX_N, integer=True)
    if best_of < n:
        raise BadField("best_of", f"'best_of' ({best_of}) must be at least 'n' ({n})")
    stream = _flag(body, "stream", False)
    if best_of > n and stream:
        raise BadField("best_of", "'best_of' greater than 'n' cannot be streamed: the best are known at the end")
    if best_of > 1 and params.temperature == 0:
        raise BadField("best_of", "'best_of' greater than 1 needs sampling ('temperature' > 0): greedy candidates "
                                  "are all the same")
    if len(prompts) * best_of > MAX_N * 4:
        raise BadField("n", f"{len(prompts)} prompts x {best_of} choices is more than the {MAX_N * 4} sequences one "
                            "request may start")
    options_ = body.get("stream_options")
    if options_ is not None and not (isinstance(options_, dict) and set(options_) <= {"include_usage"}
                                     and isinstance(options_.get("include_usage", False), bool)):
        raise BadField("stream_options", "'stream_options' is {\"include_usage\": true or false}")
    echo = not chat and _flag(body, "echo", False)
    if echo:
        params = dataclasses.replace(params, prompt_logprobs=params.logprobs)
    return Ask(body, prompts, params, options["stops"], n, stream, chat, adapter, best_of, echo,
               options["skip_special"], options["ids_as_tokens"], extra)
