"""OpenAI-compatible endpoints on the continuous-batching engine: what the `openai` client, LangChain and the
vLLM / SGLang benchmark scripts speak.

    GET  /v1/models
    POST /v1/completions          prompt (a string, strings, or token ids), n choices each (best_of candidates)
    POST /v1/chat/completions     messages rendered with the model's chat template
    POST /tokenize, /detokenize   vLLM's: a prompt or messages to token ids, token ids to text

The request's fields are read in plait.serve.entrypoints.openai_request (one engine request per choice), the text
and log-probabilities are shaped in openai_text. Each choice i of a request with a seed samples with seed + i.
Streams are server-sent events, each a chunk object, then `data: [DONE]`; stream_options.include_usage adds a last
chunk with the counts.

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

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from plait.data.hf_tokenizer import HFTokenizer
from plait.serve.engine.core import SamplingParams, TokenEvent
from plait.serve.engine.grammar import Grammars
from plait.serve.entrypoints.openai_request import (
    Ask,
    BadField,
    _flag,
    chat_prompt,
    completion_prompts,
    max_model_len,
    parse,
    structured,
)
from plait.serve.entrypoints.openai_text import Text, Tokens, chat_logprobs, completion_logprobs, decoder, kept
from plait.serve.entrypoints.protocol import check_items, loads
from plait.serve.entrypoints.tool_calls import Reply, whole
from plait.serve.errors import RequestError
from plait.serve.service import Completion, Service

OPENAI_PATHS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
MAX_ITEMS = 16_384  # values, arrays and objects in one body (a conversation of many messages; token-id prompts)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error", 499: "invalid_request_error", 503: "server_error", 504: "timeout"}


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


def error_of(e: Exception) -> JSONResponse:
    if isinstance(e, RequestError):
        code = "model_not_found" if e.status == 404 else "invalid_api_key" if e.status == 401 else None
        return openai_error(e.status, str(e), getattr(e, "param", None), code)
    return openai_error(500, f"internal error: {type(e).__name__}: {e}")


def openai_routes(app: FastAPI, service: Service, read_body, limit: int) -> None:
    """Add the endpoints; `read_body(request, limit, timeout_s, flag)` is the app's body reader."""

    async def body_of(request: Request) -> tuple[dict, int]:
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
        return body, adapter

    @app.get("/v1/models", summary="models (OpenAI)")
    async def models():
        base = {"id": service.name, "object": "model", "created": int(service.started), "owned_by": "plait",
                "root": service.ref.path, "max_model_len": max_model_len(service)}
        return {"object": "list", "data": [base] + [base | {"id": name, "parent": service.name}
                                                    for name in service.adapters]}

    grammars = grammars_of(service)

    async def endpoint(request: Request, chat: bool) -> Response:
        try:
            body, adapter = await body_of(request)
            if structured(body) is not None or body.get("tools"):  # a grammar compiles off the loop (and llguidance
                # reads the tokenizer there, once)
                ask = await asyncio.get_running_loop().run_in_executor(None, parse, service, body, chat, adapter,
                                                                       grammars)
            else:
                ask = parse(service, body, chat, adapter)
        except Exception as e:
            return error_of(e)
        return await _answer(service, request.scope["state"]["arrived"], ask)

    @app.post("/v1/completions", summary="completions (OpenAI)")
    async def completions(request: Request):
        return await endpoint(request, chat=False)

    @app.post("/v1/chat/completions", summary="chat completions (OpenAI)")
    async def chat_completions(request: Request):
        return await endpoint(request, chat=True)
    _token_routes(app, service, body_of)


def _token_routes(app: FastAPI, service: Service, body_of) -> None:
    """vLLM's /tokenize and /detokenize; `body_of(request)` reads and checks a body as the OpenAI routes do."""

    @app.post("/tokenize", summary="text or messages to token ids (vLLM)")
    async def tokenize(request: Request):
        try:
            body, _ = await body_of(request)
            unknown = sorted(set(body) - {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                                          "return_token_strs"})
            if unknown or ("prompt" in body) == ("messages" in body):
                raise BadField(unknown[0] if unknown else "prompt", "/tokenize takes 'prompt' (a string) or 'messages', "
                                                                    "with model and return_token_strs")
            if "messages" in body:
                ids = chat_prompt(service, body["messages"])
            elif isinstance(body["prompt"], str):
                ids = completion_prompts(service, body["prompt"])[0]
            else:
                raise BadField("prompt", "'prompt' must be a string")
            out = {"count": len(ids), "max_model_len": max_model_len(service), "tokens": ids}
            if _flag(body, "return_token_strs", False):
                out["token_strs"] = [service.served.tokenizer.decode([t]) for t in ids]
            return JSONResponse(out)
        except Exception as e:
            return error_of(e)

    @app.post("/detokenize", summary="token ids to text (vLLM)")
    async def detokenize(request: Request):
        try:
            body, _ = await body_of(request)
            ids, vocab = body.get("tokens"), service.served.vocab_size
            if sorted(set(body) - {"model", "tokens"}) or not isinstance(ids, list) or not all(
                    isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids):
                raise BadField("tokens", f"/detokenize takes 'tokens', a list of token ids in [0, {vocab}), and model")
            return JSONResponse({"prompt": service.served.tokenizer.decode(ids)})
        except Exception as e:
            return error_of(e)


def _last(reply: Reply, text: str) -> tuple[str, list]:
    """What a reply still holds at its end: the last text's content and calls, then what closing it gives."""
    content, calls = reply.feed(text)
    rest, more = reply.finish()
    return content + rest, calls + more


def grammars_of(service: Service) -> Grammars | None:
    """The served model's grammars for structured output (None without a Hugging Face tokenizer)."""
    tok = service.served.tokenizer
    if not isinstance(tok, HFTokenizer):
        return None
    return Grammars.of_model(tok.to_json(), service.served.vocab_size, service.served.eos_ids)


def _jobs(ask: Ask) -> list[tuple[int, int, list[int], SamplingParams]]:
    """(prompt index, candidate index, prompt, sampling) for each of best_of candidates of each prompt; candidate j
    samples with seed + j. Candidates that must be ranked (best_of > n) report their tokens' log-probabilities."""
    p = ask.params
    if ask.best_of > ask.n and p.logprobs is None:
        p = dataclasses.replace(p, logprobs=0)
    return [(i, j, prompt, dataclasses.replace(p, seed=p.seed + j))
            for i, prompt in enumerate(ask.prompts) for j in range(ask.best_of)]


def _best(ask: Ask, jobs, results: list[Completion]) -> list[int]:
    """The jobs answered: per prompt, the n candidates of the highest mean token log-probability (best_of > n)."""
    if ask.best_of == ask.n:
        return list(range(len(jobs)))
    chosen = []
    for i in range(len(ask.prompts)):
        mine = [k for k, job in enumerate(jobs) if job[0] == i]
        score = {k: sum(e.logprob or 0.0 for e in results[k].events) / max(1, len(results[k].events)) for k in mine}
        chosen += sorted(sorted(mine, key=lambda k: -score[k])[:ask.n])
    return chosen


def _echoed(service: Service, ask: Ask, prompt: list[int], first: TokenEvent | None) -> tuple[str, list]:
    """The prompt's text and its (token, logprob, top) rows for an echoed completion (from its first token's event,
    which carries the prompt's log-probabilities)."""
    text = decoder(service.served.tokenizer, ask.skip_special)(prompt)
    lps = first.prompt if first is not None else ()
    rows = [(prompt[0], None, ())] + [(t, lp, top) for t, (lp, top) in zip(prompt[1:], lps)]
    return text, rows


async def _answer(service: Service, arrived: float, ask: Ask) -> Response:
    chat = ask.chat
    head = {"id": ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12),
            "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": ask.body.get("model", service.name)}
    jobs = _jobs(ask)
    tok = service.served.tokenizer
    decode, show = decoder(tok, ask.skip_special), Tokens(tok, ask.ids_as_tokens)
    if ask.stream:
        include_usage = bool((ask.body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(_stream(service, head, ask, jobs, include_usage, arrived),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    texts = [Text(decode, ask.stops, ask.params.min_tokens) for _ in jobs]

    def runner(k: int):
        _, _, prompt, p = jobs[k]
        return service.complete(prompt, p, arrived, lambda ev: texts[k].add(ev.token),
                                (lambda _events: texts[k].stopped) if ask.stops else None, ask.adapter)

    try:
        results: list[Completion] = await asyncio.gather(*(runner(k) for k in range(len(jobs))))
    except Exception as e:
        return error_of(e)
    choices = []
    for index, k in enumerate(_best(ask, jobs, results)):
        text, done = texts[k], results[k]
        text.flush()
        events = kept(text, done.events)
        reason = "stop" if text.stopped or done.finish_reason == "stop" else "length"
        want_lp = ask.params.logprobs is not None
        if chat:
            message: dict = {"role": "assistant", "content": text.text}
            if ask.extra.get("tools"):
                content, calls = whole(text.text, ask.extra["tools"]["mode"])
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": [c.as_json() for c in calls]}
                    reason = "tool_calls" if reason == "stop" else reason
            choice = {"index": index, "message": message,
                      "logprobs": chat_logprobs(show, events) if want_lp else None, "finish_reason": reason}
        else:
            prefix, rows = _echoed(service, ask, jobs[k][2], done.events[0] if done.events else None) if ask.echo \
                else ("", None)
            choice = {"index": index, "text": prefix + text.text,
                      "logprobs": completion_logprobs(show, events, 0, rows) if want_lp else None,
                      "finish_reason": reason}
        choices.append(choice)
    completion_tokens = sum(len(d.events) for d in results)
    prompt_tokens = sum(len(p) for p in ask.prompts)
    return JSONResponse(head | {"choices": choices, "usage": {
        "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens}})


class Chunks:
    """The server-sent chunks of one streamed request: each choice's text, log-probabilities and (chat with tools)
    tool calls as they close, in OpenAI's chunk objects."""

    def __init__(self, head: dict, ask: Ask, show: Tokens, choices: int):
        self.head, self.chat, self.show = head, ask.chat, show
        self.kind = "chat.completion.chunk" if ask.chat else "text_completion"
        self.want_lp = ask.params.logprobs is not None
        tools = ask.extra.get("tools")
        self.replies = [Reply(tools["mode"]) for _ in range(choices)] if tools else None
        self.called = [0] * choices  # tool calls sent per choice

    def __call__(self, k: int, text: str | None, events: list, reason: str | None, first: bool = False,
                 prompt_rows: list | None = None) -> str:
        """One chunk's `data:` line ("" when a choice with tools has nothing to send yet)."""
        show, want_lp = self.show, self.want_lp
        if self.chat and self.replies is not None and not first:
            reply = self.replies[k]
            text, calls = reply.feed(text or "") if reason is None else _last(reply, text or "")
            deltas = [c.as_json(self.called[k] + i) for i, c in enumerate(calls)]
            self.called[k] += len(calls)
            reason = "tool_calls" if reason == "stop" and self.called[k] else reason
            if not (text or deltas or reason or (want_lp and events)):
                return ""
            delta = ({"content": text} if text else {}) | ({"tool_calls": deltas} if deltas else {})
            choice = {"index": k, "delta": delta, "logprobs": chat_logprobs(show, events) if want_lp and events else None,
                      "finish_reason": reason}
        elif self.chat:
            delta = ({"role": "assistant", "content": ""} if first else {}) | ({"content": text} if text else {})
            choice = {"index": k, "delta": delta, "logprobs": chat_logprobs(show, events) if want_lp and events else None,
                      "finish_reason": reason}
        else:
            lp = completion_logprobs(show, events, 0, prompt_rows) if want_lp and (events or prompt_rows) else None
            choice = {"index": k, "text": text or "", "logprobs": lp, "finish_reason": reason}
        return f"data: {json.dumps(self.head | {'object': self.kind, 'choices': [choice]})}\n\n"


async def _stream(service: Service, head: dict, ask: Ask, jobs, include_usage: bool,
                  arrived: float) -> AsyncIterator[str]:
    """Chunks as the tokens come (every choice's interleaved), then the finish reasons, usage and [DONE]."""
    chat = ask.chat
    kind = "chat.completion.chunk" if chat else "text_completion"
    queue: asyncio.Queue = asyncio.Queue()
    tok = service.served.tokenizer
    texts = [Text(decoder(tok, ask.skip_special), ask.stops, ask.params.min_tokens) for _ in jobs]
    counts = [0] * len(jobs)
    want_lp = ask.params.logprobs is not None
    chunk = Chunks(head, ask, Tokens(tok, ask.ids_as_tokens), len(jobs))

    async def run(k: int):
        _, _, prompt, p = jobs[k]

        def on_event(ev) -> None:
            counts[k] += 1
            queue.put_nowait(("token", k, texts[k].add(ev.token), ev))

        try:
            done = await service.complete(prompt, p, arrived, on_event,
                                          (lambda _e: texts[k].stopped) if ask.stops else None, ask.adapter)
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
                if ask.echo and extra.index == 0:  # the prompt's text (and log-probabilities) before its first token
                    prefix, rows = _echoed(service, ask, jobs[k][2], extra)
                    yield chunk(k, prefix + value, [extra] if want_lp else [], None, prompt_rows=rows)
                elif (value or want_lp) and not (texts[k].stopped and not value):
                    out = chunk(k, value, [extra] if want_lp else [], None)
                    if out:
                        yield out
            elif what == "done":
                left -= 1
                yield chunk(k, value, [], extra)
            else:
                yield f"data: {json.dumps(json.loads(bytes(error_of(value).body)))}\n\n"
                return
        if include_usage:
            prompt_tokens, completion_tokens = sum(len(p) for p in ask.prompts), sum(counts)
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                     "total_tokens": prompt_tokens + completion_tokens}
            yield f"data: {json.dumps(head | {'object': kind, 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
