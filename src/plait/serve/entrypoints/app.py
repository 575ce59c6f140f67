"""The ASGI app: Open Inference Protocol (KServe v2) endpoints, text generation, metrics, auth and access log.

    GET  /v2/health/live, /v2/health/ready, /v2, /v2/models, /v2/models/{name}[/versions/{v}]
    GET  /v2/models/{name}/ready, /v2/models/{name}/config
    POST /v2/models/{name}[/versions/{v}]/infer      JSON tensors or the binary tensor data extension
    POST /v2/repository/index                        Triton's repository-index extension
    POST /v1/generate                                text generation (gpt), optionally server-sent events
    GET  /v1/models, POST /v1/completions, /v1/chat/completions    OpenAI-compatible (plait.serve.entrypoints.openai_api)
    GET  /metrics                                    Prometheus

Handlers read raw bodies (the binary framing is not JSON), so errors are the protocol's own
`{"error": message}` with 400/401/404/408/413/431/499/503/504, never FastAPI's 422, and never a 500 for
anything a client sends (docs/security.md). A whole body must arrive within --read-timeout-s (else
408, and the connection is closed); a head over MAX_HEAD_BYTES is a 431 however its bytes came. Bodies
are counted before they are parsed (protocol.check_items), large ones decoded, and large answers
encoded, on the service's codec thread so that the event loop keeps answering; under --autoscale an
infer request whose client goes away while it is held is dropped. Metric labels come from the route
table (anything else is `other`), so requests to made-up paths cannot grow the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from plait.serve.entrypoints.generate_request import gen_row
from plait.serve.entrypoints.openai_api import OPENAI_PATHS, openai_error, openai_routes
from plait.serve.entrypoints.protocol import (
    HEADER_LENGTH,
    check_inputs,
    check_items,
    decode_infer_request,
    encode_error,
    encode_infer_response,
    loads,
)
from plait.serve.errors import RequestError
from plait.serve.metrics import access_logger, access_record
from plait.serve.service import Service

OPEN_PATHS = ("/v2/health/live", "/v2/health/ready")  # probes work without the token
MAX_HEAD_BYTES = 64 * 1024  # a request head (request line + headers) at most this long: 431 beyond
GENERATE_MAX_ITEMS = 1024  # values, arrays and objects in a /v1/generate body (one object of a few fields) at most

TENSOR_SCHEMA = {
    "type": "object", "required": ["name", "shape", "datatype"],
    "properties": {
        "name": {"type": "string"}, "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "datatype": {"type": "string", "enum": ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32",
                                                "INT64", "FP16", "FP32", "FP64"]},
        "parameters": {"type": "object", "properties": {"binary_data_size": {"type": "integer", "minimum": 0}}},
        "data": {"type": "array", "items": {}},
    },
}
INFER_SCHEMA = {
    "type": "object", "required": ["inputs"],
    "properties": {
        "id": {"type": "string"},
        "parameters": {"type": "object", "properties": {"binary_data_output": {"type": "boolean"}}},
        "inputs": {"type": "array", "minItems": 1, "items": TENSOR_SCHEMA},
        "outputs": {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"},
            "parameters": {"type": "object", "properties": {"binary_data": {"type": "boolean"}}}}}},
    },
}
GENERATE_SCHEMA = {
    "type": "object", "required": ["prompt"],
    "properties": {
        "prompt": {"type": "string", "minLength": 1}, "max_new_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0}, "top_k": {"type": ["integer", "null"], "minimum": 1},
        "seed": {"type": ["integer", "null"], "minimum": 0}, "stream": {"type": "boolean"}, "model": {"type": "string"},
    },
}


def _body(schema: dict, description: str) -> dict:
    return {"requestBody": {"required": True, "description": description,
                            "content": {"application/json": {"schema": schema},
                                        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}


def error_response(e: Exception, headers: dict[str, str] | None = None) -> Response:
    """`e` answered as the middleware's infer path answers it (protocol.encode_error), plus `headers`."""
    status, body, base = encode_error(e)
    return Response(body, status_code=status, headers=base | (headers or {}))


# The metric label of each route; a path that matches none is `other` (bounded label values).
ROUTE_LABELS: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"/v2/models/[^/]+(/versions/[^/]+)?/infer"), "infer"),
    (re.compile(r"/v1/generate"), "generate"),
    (re.compile(r"/v1/completions"), "completions"),
    (re.compile(r"/v1/chat/completions"), "chat"),
    (re.compile(r"/v1/models"), "models"),
    (re.compile(r"/v2/health/(live|ready)"), "health"),
    (re.compile(r"/v2|/v2/models|/v2/repository/index|/v2/models/[^/]+(/versions/[^/]+)?(/ready|/config)?"), "metadata"),
    (re.compile(r"/metrics"), "metrics"),
    (re.compile(r"/docs|/docs/oauth2-redirect|/redoc|/openapi\.json"), "docs"),
)


def endpoint_of(path: str) -> str:
    """A low-cardinality label for metrics: the route's, or `other` for paths no route serves."""
    for pattern, label in ROUTE_LABELS:
        if pattern.fullmatch(path):
            return label
    return "other"


def head_size(scope) -> int:
    """The bytes of a request's head as parsed (request line and headers; the separators counted as on the wire)."""
    return (len(scope["method"]) + len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + 14
            + sum(len(k) + len(v) + 4 for k, v in scope["headers"]))


async def receive_body(receive, headers: dict, limit: int, timeout_s: float, flag: str = "--max-body-mb") -> bytes:
    """The request body from ASGI `receive`: 413 over `limit` bytes (before reading it all), 408 when the whole body has
    not come within `timeout_s` (a total deadline: a client that drips a byte a second is cut too), 400 when the
    client goes away half-way."""
    declared = headers.get(b"content-length", b"")
    if declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"request body is {int(declared)} bytes; the limit is {limit} ({flag})")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    chunks, size, more = [], 0, True
    while more:
        try:
            message = await asyncio.wait_for(receive(), deadline - loop.time())
        except TimeoutError:
            raise RequestError(408, f"the request body did not arrive within {timeout_s:g} s (--read-timeout-s)") from None
        if message["type"] == "http.disconnect":
            raise RequestError(400, "the client disconnected before sending the whole body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"request body is over the limit of {limit} bytes ({flag})")
        chunks.append(chunk)
        more = message.get("more_body", False)
    return b"".join(chunks)


async def infer_body(service: Service, body: bytes, header_length: str | None, arrived: float,
                     receive=None) -> tuple[bytes, dict]:
    """Decode, check, batch, run and encode one infer request: the answer's body and headers. Under --autoscale (a
    request may be held through a cold start) `receive` is watched: a client that goes away drops its request."""
    req = await service.off_loop(decode_infer_request, body, header_length, service.max_json_items, service.items_hint,
                                 size=len(body))
    s = service.served
    check_inputs(req, service.name, s.inputs, service.opts.max_batch_size)
    x = req.inputs[s.inputs[0].name]
    if s.is_lm:
        if x.shape[1] > s.context:
            raise RequestError(400, f"input 'input_ids' has {x.shape[1]} tokens; the model's context is {s.context}")
        if x.min() < 0 or x.max() >= s.vocab_size:
            raise RequestError(400, f"input 'input_ids' holds ids outside [0, {s.vocab_size}) (the vocabulary)")
    if service.opts.autoscale is not None and receive is not None:
        outputs = await _unless_disconnected(service.infer(x, arrived), receive)
        if outputs is None:
            raise RequestError(499, "the client went away before the answer; the request was dropped")
    else:
        outputs = await service.infer(x, arrived)
    values = sum(v.size for v in outputs.values())
    return await service.off_loop(encode_infer_response, service.name, req, outputs, s.outputs, size=values)


class Observe:
    """Pure ASGI middleware: bearer-token check, request metrics and one JSON access-log line per request.

    It also answers `POST /v2/models/{name}/infer` itself, without the framework's routing and
    middleware stack: on a small model that stack costs more CPU than the model, and batching
    only pays off when the per-request overhead is small next to the compute it shares.
    """

    def __init__(self, app, service: Service):
        self.app, self.service = app, service
        self.log = access_logger()
        token = service.opts.token
        self.expected = f"Bearer {token}".encode() if token else None
        self.infer_path = f"/v2/models/{service.name}/infer"
        self.limit = int(service.opts.max_body_mb * 1024 * 1024)

    async def _infer(self, scope, receive, send) -> None:
        headers = dict(scope["headers"])
        try:
            body = await receive_body(receive, headers, self.limit, self.service.opts.read_timeout_s)
            length = headers.get(HEADER_LENGTH.lower().encode())
            content, out_headers = await infer_body(self.service, body,
                                                    None if length is None else length.decode("latin-1"),
                                                    scope["state"]["arrived"], receive)
            status = 200
        except Exception as e:  # RequestError and any other: the same answer as the framework's routes give
            status, content, out_headers = encode_error(e)
        raw = [(k.encode(), v.encode()) for k, v in out_headers.items()] + [(b"content-length", str(len(content)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": content})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        scope.setdefault("state", {})["arrived"] = started
        seen = {"status": 500, "bytes": 0}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
            elif message["type"] == "http.response.body":
                seen["bytes"] += len(message.get("body", b""))
            await send(message)

        path = scope["path"]
        try:
            if head_size(scope) > MAX_HEAD_BYTES:  # whole in one read (the server cuts a head that arrives in parts)
                resp = error_response(RequestError(431, f"the request head is over {MAX_HEAD_BYTES} bytes"))
                return await resp(scope, receive, send_wrapper)
            if self.expected is not None and path not in OPEN_PATHS:
                given = dict(scope["headers"]).get(b"authorization", b"")
                if not secrets.compare_digest(given, self.expected):
                    if path in OPENAI_PATHS:
                        resp = openai_error(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>'",
                                            code="invalid_api_key")
                        resp.headers["www-authenticate"] = "Bearer"
                        return await resp(scope, receive, send_wrapper)
                    resp = error_response(RequestError(401, "missing or wrong bearer token: send 'Authorization: "
                                                            "Bearer <token>'"), {"www-authenticate": "Bearer"})
                    return await resp(scope, receive, send_wrapper)
            if scope["method"] == "POST" and path == self.infer_path:
                await self._infer(scope, receive, send_wrapper)
            else:
                await self.app(scope, receive, send_wrapper)
        finally:
            label = endpoint_of(path)
            m = self.service.metrics
            m.requests.labels(label, str(seen["status"])).inc()
            m.latency.labels(label).observe(time.perf_counter() - started)
            client = scope.get("client")
            self.log.info(access_record(scope["method"], path, seen["status"], started,
                                        f"{client[0]}:{client[1]}" if client else None, seen["bytes"]))


async def read_body(request: Request, limit: int, timeout_s: float, flag: str = "--max-body-mb") -> bytes:
    """The request body, refusing (413) anything over `limit` bytes before reading it all (see receive_body)."""
    return await receive_body(request.receive, dict(request.scope["headers"]), limit, timeout_s, flag)


async def _disconnected(receive) -> None:
    """Returns when the client has gone away (call once the body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def create_app(service: Service) -> FastAPI:
    """The app for one service; its lifespan starts and stops the service's workers."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="plait serve", version="1", lifespan=lifespan,
                  description="Open Inference Protocol (KServe v2) and text generation for plait models.")
    _error_handlers(app)
    # Registered in this order: it is the order of the OpenAPI document's paths.
    _health_routes(app, service)
    _metadata_routes(app, service)
    _infer_routes(app, service)
    _generate_routes(app, service)
    openai_routes(app, service, read_body, _generate_limit(service)[0])

    @app.get("/metrics", summary="Prometheus metrics")
    async def metrics():
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4")

    return Observe(app, service)  # type: ignore[return-value]


def _error_handlers(app: FastAPI) -> None:
    """Every error is the protocol's `{"error": message}` (protocol.encode_error), never FastAPI's 422 or HTML."""

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, e: RequestError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        message = f"no such endpoint: {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return error_response(RequestError(e.status_code, message))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        return error_response(e)


def _model_or_404(service: Service, model: str, version: str | None = None) -> None:
    if model != service.name:
        raise RequestError(404, f"unknown model '{model}'; this server serves: {service.name}")
    if version not in (None, "", "1"):
        raise RequestError(404, f"model '{model}' has no version '{version}'; it has version 1")


def _health_routes(app: FastAPI, service: Service) -> None:
    @app.get("/v2/health/live", summary="liveness")
    async def live():
        return {"live": True}

    @app.get("/v2/health/ready", summary="readiness (every model can answer)")
    async def ready():
        ok = service.ready()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)


def _index(service: Service) -> list[dict]:
    return [{"name": service.name, "version": "1", "state": "READY" if service.ready() else "UNAVAILABLE"}]


def _metadata(service: Service) -> dict:
    s = service.served
    return {"name": service.name, "versions": ["1"], "platform": s.backend,
            "inputs": [t.as_json() for t in s.inputs], "outputs": [t.as_json() for t in s.outputs],
            "parameters": {"registry_name": s.registry_name, "task": s.spec.task, "checkpoint": s.checkpoint,
                           "max_batch_size": service.opts.max_batch_size, "layout": service.layout,
                           "quantize": service.opts.quantize or "none", "device": service.device}}


def _model_config(service: Service) -> dict:
    """Triton's model configuration, as far as plait has its fields."""
    s, o = service.served, service.opts

    def dims(t):
        return {"name": t.name, "data_type": "TYPE_" + t.datatype, "dims": list(t.shape[1:])}

    return {"name": service.name, "platform": s.backend, "max_batch_size": o.max_batch_size,
            "input": [dims(t) for t in s.inputs], "output": [dims(t) for t in s.outputs],
            "dynamic_batching": {"max_queue_delay_microseconds": int(o.max_delay_ms * 1000)},
            "instance_group": [{"count": o.replicas if o.pp == 1 else 1, "kind": "KIND_CPU"}]}


def _metadata_routes(app: FastAPI, service: Service) -> None:
    @app.get("/v2", summary="server metadata")
    async def server_metadata():
        return {"name": "plait", "version": "1", "extensions": ["binary_tensor_data", "model_repository"]}

    @app.get("/v2/models", summary="models served")
    async def models():
        return {"models": _index(service)}

    @app.post("/v2/repository/index", summary="Triton's repository index")
    async def repository_index():
        return _index(service)

    @app.get("/v2/models/{model}", summary="model metadata")
    async def model_metadata(model: str):
        _model_or_404(service, model)
        return _metadata(service)

    @app.get("/v2/models/{model}/versions/{version}", summary="model metadata (one version)")
    async def model_version_metadata(model: str, version: str):
        _model_or_404(service, model, version)
        return _metadata(service)

    @app.get("/v2/models/{model}/ready", summary="model readiness")
    async def model_ready(model: str):
        _model_or_404(service, model)
        ok = service.ready()
        return JSONResponse({"name": service.name, "ready": ok}, status_code=200 if ok else 503)

    @app.get("/v2/models/{model}/config", summary="Triton-style model configuration")
    async def model_config(model: str):
        _model_or_404(service, model)
        return _model_config(service)


def _body_limit(service: Service) -> int:
    return int(service.opts.max_body_mb * 1024 * 1024)


def _infer_routes(app: FastAPI, service: Service) -> None:
    limit, timeout_s = _body_limit(service), service.opts.read_timeout_s

    async def infer(request: Request, model: str, version: str | None = None) -> Response:
        """Unknown models and versioned paths (the served model's own path is answered by Observe)."""
        _model_or_404(service, model, version)
        body = await read_body(request, limit, timeout_s)
        content, headers = await infer_body(service, body, request.headers.get(HEADER_LENGTH),
                                            request.scope["state"]["arrived"], request.receive)
        return Response(content, headers=headers)

    infer_doc = _body(INFER_SCHEMA, "KServe v2 inference request; binary tensors follow the JSON header, whose "
                                    f"size the {HEADER_LENGTH} header gives")

    @app.post("/v2/models/{model}/infer", summary="inference", openapi_extra=infer_doc)
    async def model_infer(request: Request, model: str):
        return await infer(request, model)

    @app.post("/v2/models/{model}/versions/{version}/infer", summary="inference (one version)", openapi_extra=infer_doc)
    async def model_version_infer(request: Request, model: str, version: str):
        return await infer(request, model, version)


def _generate_limit(service: Service) -> tuple[int, str]:
    """The largest generate body and the flag that sets it: a prompt of at most --max-prompt-chars characters (12
    bytes each at worst: an escaped pair) and its fields, within --max-body-mb."""
    limit = _body_limit(service)
    gen_limit = min(limit, 12 * service.opts.max_prompt_chars + 64 * 1024)
    return gen_limit, "--max-prompt-chars" if gen_limit < limit else "--max-body-mb"


def _generate_routes(app: FastAPI, service: Service) -> None:
    gen_limit, gen_flag = _generate_limit(service)

    @app.post("/v1/generate", summary="text generation", openapi_extra=_body(GENERATE_SCHEMA, "generation request"))
    async def generate(request: Request):
        raw = await read_body(request, gen_limit, service.opts.read_timeout_s, gen_flag)
        check_items(raw, GENERATE_MAX_ITEMS, " (one object: prompt, max_new_tokens, temperature, ...)")
        body = await service.off_loop(loads, raw, size=len(raw))
        if not isinstance(body, dict):
            raise RequestError(400, "request body must be a JSON object with a 'prompt'")
        adapter = 0
        if "model" in body:
            model = body["model"][:200] if isinstance(body["model"], str) else "(not a string)"
            if model in service.adapters:
                adapter = service.adapter_index(model)
            else:
                _model_or_404(service, model)
        service.require_generation()
        row, stream, prompt_tokens = gen_row(service, body)
        arrived = request.scope["state"]["arrived"]
        if stream:
            return StreamingResponse(_sse(service, row, arrived, adapter), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        tokens = await _unless_disconnected(service.generate(row, arrived, adapter=adapter), request.receive)
        if tokens is None:
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        return {"model": service.name, "text": service.served.tokenizer.decode(tokens), "tokens": tokens,
                "prompt_tokens": prompt_tokens, "seed": row.seed}


async def _unless_disconnected(work, receive):
    """`work`'s result, or None when the client goes away first: a request given up is dropped by the batcher, and
    replicas are told to stop it."""
    job = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({job, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not job.done():
            job.cancel()
    if not job.done() or job.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            await job
        return None
    return job.result()


async def _sse(service: Service, row, arrived: float, adapter: int = 0):
    """Server-sent events: one `data:` line per token, then `event: done` with the whole text."""
    tok = service.served.tokenizer
    events: asyncio.Queue = asyncio.Queue()
    sent = 0

    def on_token(pos: int, token: int) -> None:
        events.put_nowait((pos, token))

    job = asyncio.ensure_future(service.generate(row, arrived, on_token, adapter))
    job.add_done_callback(lambda _: events.put_nowait(None))
    try:
        while True:
            item = await events.get()
            if item is None:
                break
            pos, token = item
            if pos < sent:  # a retried batch replays tokens already sent
                continue
            sent += 1
            yield f"data: {json.dumps({'index': pos, 'token': token, 'text': tok.decode([token])})}\n\n"
        tokens = job.result()
        yield f"event: done\ndata: {json.dumps({'text': tok.decode(tokens), 'tokens': tokens, 'seed': row.seed})}\n\n"
    except RequestError as e:
        yield f"event: error\ndata: {json.dumps({'error': str(e), 'status': e.status})}\n\n"
    except Exception as e:  # the stream has begun (200): the failure can only be told as an event
        yield f"event: error\ndata: {json.dumps({'error': f'internal error: {type(e).__name__}: {e}', 'status': 500})}\n\n"
    finally:
        if not job.done():
            job.cancel()
