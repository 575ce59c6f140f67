"""OpenAI-compatible endpoints on the continuous-batching engine: what the `openai` client, LangChain and the
vLLM / SGLang benchmark scripts speak.

    GET  /v1/models
    POST /v1/completions          prompt (a string, strings, or token ids), n choices each
    POST /v1/chat/completions     messages rendered with the model's chat template

Fields: model, max_tokens (chat: max_completion_tokens too), temperature, top_p, top_k, seed, stop (a string or
up to 4), n, logprobs (completions: the top k per token; chat: logprobs + top_logprobs), stream (server-sent
events, each a chunk object, then `data: [DONE]`; stream_options.include_usage adds a last chunk with the
counts), user (ignored). Each choice i of a request with a seed samples with seed + i. An unknown field, or
presence/frequency penalties, echo and the like that plait does not implement, are a 400 naming the field.

Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with the status codes OpenAI
uses (400 invalid request, 401 authentication, 404 unknown model, 413, 500, 503, 504).

Stop strings: the text is cut before the first stop string (not included, as OpenAI does); a streamed choice
holds back the tail that could still become one, so no stop string is ever sent. The engine stops the
sequence at once. A model whose chat template is missing (plait's own runs) uses a plain one:
"role: content" lines, then "assistant:".
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from plait.serve.engine.core import SamplingParams, TokenEvent
from plait.serve.entrypoints.protocol import check_items, loads
from plait.serve.errors import RequestError
from plait.serve.service import MIN_TEMPERATURE, SURROGATE, Completion, Service

OPENAI_PATHS = ("/v1/models", "/v1/completions", "/v1/chat/completions")
MAX_ITEMS = 16_384  # values, arrays and objects in one body (a conversation of many messages; token-id prompts)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error", 499: "invalid_request_error", 503: "server_error", 504: "timeout"}
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "stream_options",
          "user", "logprobs"}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "presence_penalty", "frequency_penalty"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "presence_penalty", "frequency_penalty"}
PLAIN_TEMPLATE = "{role}: {content}\n"


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


class BadField(RequestError):
    def __init__(self, param: str, message: str, status: int = 400):
        super().__init__(status, message)
        self.param = param


def error_of(e: Exception) -> JSONResponse:
    if isinstance(e, RequestError):
        code = "model_not_found" if e.status == 404 else "invalid_api_key" if e.status == 401 else None
        return openai_error(e.status, str(e), getattr(e, "param", None), code)
    return openai_error(500, f"internal error: {type(e).__name__}: {e}")


# ---------------------------------------------------------------------- requests


def _number(body: dict, key: str, default, low: float, high: float, integer: bool = False):
    v = body.get(key, default)
    if v is None:
        return default
    kind = int if integer else (int, float)
    if not isinstance(v, kind) or isinstance(v, bool) or not low <= v <= high:
        what = "an integer" if integer else "a number"
        raise BadField(key, f"'{key}' must be {what} between {low:g} and {high:g}, got {json.dumps(v)[:40]}")
    return v


def sampling(service: Service, body: dict, fields: set[str], chat: bool) -> tuple[SamplingParams, list[str], int, bool]:
    """The request's sampling parameters, stop strings, n and stream flag (BadField naming what is wrong)."""
    unknown = sorted(set(body) - fields)
    if unknown:
        raise BadField(unknown[0], f"unrecognized request argument: '{unknown[0][:64]}'; this endpoint takes "
                                   f"{', '.join(sorted(fields))}")
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise BadField(key, f"'{key}' is not supported by plait; leave it out or 0")
    if body.get("echo") not in (None, False):
        raise BadField("echo", "'echo' is not supported by plait; leave it out or false")
    limit = service.opts.max_new_tokens
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, key, min(16 if not chat else limit, limit), 1, limit, integer=True)
    temperature = float(_number(body, "temperature", 1.0, 0.0, 2.0))
    if 0 < temperature < MIN_TEMPERATURE:
        raise BadField("temperature", f"'temperature' must be 0 (greedy) or at least {MIN_TEMPERATURE}")
    top_p = float(_number(body, "top_p", 1.0, 0.0, 1.0))
    if top_p <= 0:
        raise BadField("top_p", "'top_p' must be greater than 0 and at most 1")
    top_k = _number(body, "top_k", None, -1, 1 << 31, integer=True)
    if top_k in (-1, 0):
        top_k = None  # vLLM's -1: no top-k
    seed = _number(body, "seed", None, 0, (1 << 63) - 1, integer=True)
    n = _number(body, "n", 1, 1, 16, integer=True)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise BadField("stop", "'stop' must be a non-empty string or a list of at most 4 of them")
    if chat:
        want = body.get("logprobs", False)
        if not isinstance(want, bool):
            raise BadField("logprobs", "'logprobs' must be true or false")
        top = _number(body, "top_logprobs", 0, 0, 20, integer=True)
        if top and not want:
            raise BadField("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        logprobs = top if want else None
    else:
        logprobs = _number(body, "logprobs", None, 0, 5, integer=True)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadField("stream", "'stream' must be true or false")
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and set(options) <= {"include_usage"}
                                    and isinstance(options.get("include_usage", False), bool)):
        raise BadField("stream_options", "'stream_options' is {\"include_usage\": true or false}")
    seed = secrets.randbits(62) if seed is None else seed
    params = SamplingParams(max_tokens, temperature, top_k, top_p, seed, service.served.eos_ids, logprobs)
    return params, stops, n, stream


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

    if isinstance(prompt, str):
        return [_encode(service, prompt, "prompt")]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [_encode(service, p, "prompt") for p in prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return [ids(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return [ids(p) for p in prompt]
    raise BadField("prompt", "'prompt' must be a string, a list of strings, or token ids")


def chat_prompt(service: Service, messages) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise BadField("messages", "'messages' must be a non-empty list of {\"role\", \"content\"} objects")
    plain = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise BadField(f"messages[{i}].content", "only text content parts ({\"type\": \"text\", \"text\": ...}) "
                                                         "are supported")
            content = "".join(p["text"] for p in content)
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(content, str)):
            raise BadField(f"messages[{i}]", f"messages[{i}] needs a string 'role' and a string (or text parts) 'content'")
        plain.append({"role": m["role"], "content": content})
    template = service.served.chat
    if template is not None:
        try:
            text = template.render(plain, add_generation_prompt=True)
        except Exception as e:  # the template's own raise_exception (an unsupported role order, say)
            raise BadField("messages", f"the model's chat template refused the conversation: {e}") from None
    else:
        text = "".join(PLAIN_TEMPLATE.format(**m) for m in plain) + "assistant:"
    return _encode(service, text, "messages")


# ---------------------------------------------------------------------- text, stop strings, logprobs


class Text:
    """A choice's text as its tokens come: what is safe to send, and whether a stop string ended it."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.tokens: list[int] = []
        self.text = ""
        self.sent = 0
        self.stopped = False
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.prefix = self.read = 0  # tokens[prefix:read] were decoded last time, as context for the next ones

    def _decode_new(self) -> None:
        """Append the text the new tokens add: each step decodes only the tokens since the last text, with the
        ones before them as context (a decoder's spacing depends on its neighbours), not the whole sequence;
        a character still in pieces waits for its next token."""
        before = self.tokenizer.decode(self.tokens[self.prefix:self.read])
        after = self.tokenizer.decode(self.tokens[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.tokens)

    def add(self, token: int) -> str:
        """The new text to send after `token` ("" while it may still be the start of a stop string; "" after a stop
        string ended the text)."""
        if self.stopped:
            return ""
        self.tokens.append(token)
        self._decode_new()
        cut = min((i for i in (self.text.find(s, max(0, self.sent - self.hold)) for s in self.stops) if i >= 0),
                  default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True
            return self.flush()
        safe = len(self.text) - self.hold
        while safe > self.sent and self.text[safe - 1] == "\ufffd":  # a character still in pieces
            safe -= 1
        out = self.text[self.sent:max(safe, self.sent)]
        self.sent += len(out)
        return out

    def flush(self) -> str:
        if not self.stopped and self.read < len(self.tokens):  # the end: a character left in pieces is sent as it is
            before = self.tokenizer.decode(self.tokens[self.prefix:self.read])
            self.text += self.tokenizer.decode(self.tokens[self.prefix:])[len(before):]
            self.prefix = self.read = len(self.tokens)
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out


def _token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def completion_logprobs(tokenizer, events: list[TokenEvent], offset: int = 0) -> dict:
    tokens = [_token_text(tokenizer, e.token) for e in events]
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in events],
            "top_logprobs": [{_token_text(tokenizer, t): lp for t, lp in e.top} for e in events],
            "text_offset": offsets}


def chat_logprobs(tokenizer, events: list[TokenEvent]) -> dict:
    def entry(token: int, logprob: float | None) -> dict:
        text = _token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [entry(e.token, e.logprob) | {"top_logprobs": [entry(t, lp) for t, lp in e.top]} for e in events]}


def _kept(text: Text, events: list[TokenEvent]) -> list[TokenEvent]:
    """The events whose tokens are in the text (a stop string cuts the last ones)."""
    if not text.stopped:
        return events
    kept, length = [], 0
    for e in events:
        if length >= len(text.text):
            break
        kept.append(e)
        length += len(_token_text(text.tokenizer, e.token))
    return kept


# ---------------------------------------------------------------------- routes


@dataclass
class Ask:
    """One parsed request: its prompts' tokens, sampling, stop strings, n, streaming, and the adapter it names."""

    body: dict
    prompts: list[list[int]]
    params: SamplingParams
    stops: list[str]
    n: int
    stream: bool
    chat: bool
    adapter: int


def openai_routes(app: FastAPI, service: Service, read_body, limit: int) -> None:
    """Add the three endpoints; `read_body(request, limit, timeout_s, flag)` is the app's body reader."""

    async def parse(request: Request, chat: bool) -> Ask:
        raw = await read_body(request, limit, service.opts.read_timeout_s, "--max-prompt-chars")
        check_items(raw, MAX_ITEMS, " (one request object)")
        body = await service.off_loop(loads, raw, size=len(raw))
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        model = body.get("model", service.name)
        try:
            adapter = service.adapter_index(model if isinstance(model, str) else "")
        except RequestError:
            shown = model[:200] if isinstance(model, str) else "(not a string)"
            raise BadField("model", f"the model '{shown}' does not exist; this server serves: "
                                    f"{', '.join([service.name, *service.adapters])}", 404) from None
        service.require_generation()
        params, stops, n, stream = sampling(service, body, CHAT_FIELDS if chat else COMPLETION_FIELDS, chat)
        prompts = [chat_prompt(service, body.get("messages"))] if chat else completion_prompts(service, body.get("prompt"))
        return Ask(body, prompts, params, stops, n, stream, chat, adapter)

    @app.get("/v1/models", summary="models (OpenAI)")
    async def models():
        base = {"id": service.name, "object": "model", "created": int(service.started), "owned_by": "plait"}
        return {"object": "list", "data": [base] + [base | {"id": name, "parent": service.name}
                                                    for name in service.adapters]}

    async def endpoint(request: Request, chat: bool) -> Response:
        try:
            ask = await parse(request, chat)
        except Exception as e:
            return error_of(e)
        return await _answer(service, request.scope["state"]["arrived"], ask)

    @app.post("/v1/completions", summary="completions (OpenAI)")
    async def completions(request: Request):
        return await endpoint(request, chat=False)

    @app.post("/v1/chat/completions", summary="chat completions (OpenAI)")
    async def chat_completions(request: Request):
        return await endpoint(request, chat=True)


def _jobs(service: Service, ask: Ask) -> list[tuple[int, list[int], SamplingParams]]:
    """(choice index, prompt, sampling) for each of n choices of each prompt; choice j samples with seed + j."""
    params, body = ask.params, ask.body
    given = body.get("max_tokens") is not None or body.get("max_completion_tokens") is not None
    room = service.engine.max_length if service.engine is not None and not given else None

    def budget(prompt: list[int]) -> int:  # no max_tokens given: what is left of a gpt's context
        return params.max_tokens if room is None else max(1, min(params.max_tokens, room - len(prompt)))

    return [(i * ask.n + j, p, dataclasses.replace(params, max_tokens=budget(p), seed=params.seed + j))
            for i, p in enumerate(ask.prompts) for j in range(ask.n)]


async def _answer(service: Service, arrived: float, ask: Ask) -> Response:
    chat = ask.chat
    head = {"id": ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12),
            "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": ask.body.get("model", service.name)}
    jobs = _jobs(service, ask)
    tok = service.served.tokenizer
    if ask.stream:
        include_usage = bool((ask.body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(_stream(service, head, jobs, ask.stops, chat, include_usage, arrived, tok, ask.prompts,
                                         ask.adapter),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    texts = [Text(tok, ask.stops) for _ in jobs]

    def runner(k: int):
        _, prompt, p = jobs[k]

        def on_event(ev: TokenEvent) -> None:
            texts[k].add(ev.token)

        return service.complete(prompt, p, arrived, on_event,
                                (lambda _events: texts[k].stopped) if ask.stops else None, ask.adapter)

    try:
        results: list[Completion] = await asyncio.gather(*(runner(k) for k in range(len(jobs))))
    except Exception as e:
        return error_of(e)
    choices = []
    for (index, _, p), text, done in zip(jobs, texts, results):
        text.flush()
        events = _kept(text, done.events)
        reason = "stop" if text.stopped or done.finish_reason == "stop" else "length"
        if chat:
            choice = {"index": index, "message": {"role": "assistant", "content": text.text},
                      "logprobs": chat_logprobs(tok, events) if p.logprobs is not None else None,
                      "finish_reason": reason}
        else:
            choice = {"index": index, "text": text.text,
                      "logprobs": completion_logprobs(tok, events) if p.logprobs is not None else None,
                      "finish_reason": reason}
        choices.append(choice)
    completion_tokens = sum(len(d.events) for d in results)
    prompt_tokens = sum(len(p) for p in ask.prompts)
    return JSONResponse(head | {"choices": choices, "usage": {
        "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens}})


async def _stream(service: Service, head: dict, jobs, stops: list[str], chat: bool, include_usage: bool,
                  arrived: float, tok, prompts, adapter: int) -> AsyncIterator[str]:
    """Chunks as the tokens come (every choice's interleaved), then the finish reasons, usage and [DONE]."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    queue: asyncio.Queue = asyncio.Queue()
    texts = [Text(tok, stops) for _ in jobs]
    counts = [0] * len(jobs)

    def chunk(index: int, text: str | None, events: list[TokenEvent], reason: str | None, first: bool = False) -> str:
        p = jobs[index][2]
        if chat:
            delta = ({"role": "assistant", "content": ""} if first else {}) | ({"content": text} if text else {})
            choice = {"index": jobs[index][0], "delta": delta,
                      "logprobs": chat_logprobs(tok, events) if p.logprobs is not None and events else None,
                      "finish_reason": reason}
        else:
            choice = {"index": jobs[index][0], "text": text or "",
                      "logprobs": completion_logprobs(tok, events) if p.logprobs is not None and events else None,
                      "finish_reason": reason}
        return f"data: {json.dumps(head | {'object': kind, 'choices': [choice]})}\n\n"

    async def run(k: int):
        _, prompt, p = jobs[k]

        def on_event(ev: TokenEvent) -> None:
            counts[k] += 1
            text = texts[k].add(ev.token)
            queue.put_nowait(("token", k, text, ev))

        try:
            done = await service.complete(prompt, p, arrived, on_event, (lambda _e: texts[k].stopped) if stops else None,
                                          adapter)
            queue.put_nowait(("done", k, texts[k].flush(), "stop" if texts[k].stopped or done.finish_reason == "stop"
                              else "length"))
        except Exception as e:
            queue.put_nowait(("error", k, e, None))

    tasks = [asyncio.ensure_future(run(k)) for k in range(len(jobs))]
    left = len(jobs)
    try:
        if chat:
            for k in range(len(jobs)):
                yield chunk(k, None, [], None, first=True)
        while left:
            what, k, value, extra = await queue.get()
            if what == "token":
                if texts[k].stopped and not value:
                    continue
                if value or jobs[k][2].logprobs is not None:
                    yield chunk(k, value, [extra] if jobs[k][2].logprobs is not None else [], None)
            elif what == "done":
                left -= 1
                yield chunk(k, value, [], extra)
            else:
                e = value
                body = json.loads(bytes(error_of(e).body))
                yield f"data: {json.dumps(body)}\n\n"
                return
        if include_usage:
            prompt_tokens, completion_tokens = sum(len(p) for p in prompts), sum(counts)
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                     "total_tokens": prompt_tokens + completion_tokens}
            yield f"data: {json.dumps(head | {'object': kind, 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
