"""HTTP transport between `plait fed server` and `plait fed client` (FastAPI + uvicorn, httpx).

Every request carries `Authorization: Bearer <token>`; the token must be the client's own
(a tokens file may give each client id its own token) or the shared one. TLS is uvicorn's
(--ssl-certfile/--ssl-keyfile on the server, --ca-file on the client). Clients poll; the
server never calls out, so clients may sit behind NAT.

    POST /v1/register {client_id, public_key, fingerprint}  -> {"rounds": R}       (409: other config)
    GET  /v1/task?client_id=i     -> {"status": train|unmask|wait|done, ...} + the weights when training
    POST /v1/update?client_id=i&round=r   body: tensor message (delta or masked vector + meta)
    POST /v1/unmask {client_id, round, seeds}
    GET  /v1/status               -> the round in progress (monitoring and tests)

The token is checked before a body is read: a request whose bearer token is none of the
server's gets 401 whatever its body holds; the client's own token (a per-client tokens file)
is checked once the body has named the client (register, unmask) or from the query (update,
task). Bodies above the size of a model upload (plus slack) are refused with 413 before they are read
in full; bodies that do not parse (including JSON nested too deeply, NaN/Infinity or integers
too long to convert) are answered with 400, as are public keys outside the Diffie-Hellman
group; rejected updates with 422 and the reason. None of these reach anything that could stop
the server.
"""

from __future__ import annotations

import json
import ssl
import sys
import threading
import time

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from plait.federated.tensors import Weights, decode, encode
from plait.federated.wire import FederatedError, RoundService, authorized, frame, parse_tokens, unframe
from plait.jsondepth import too_deep

# FederatedError, frame, parse_tokens and unframe live in wire.py; callers that imported them from here still can.
__all__ = ["FedHTTPClient", "FederatedError", "HTTPServerThread", "frame", "make_app", "parse_tokens", "unframe"]


def _no_constant(token: str):
    raise ValueError(f"{token} is not JSON")


def _deny(status: int, reason: str) -> JSONResponse:
    return JSONResponse({"accepted": False, "reason": reason}, status_code=status)


def _client_of(request: Request) -> int | None:
    try:
        return int(request.query_params["client_id"])
    except (KeyError, ValueError):
        return None


async def _read_body(request: Request, max_body: int) -> bytes | None:
    """The body, or None once it is (or says it will be) over `max_body` bytes: a huge upload is never read whole."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_body:
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


async def _read_json(request: Request, max_body: int) -> dict | None:
    body = await _read_body(request, max_body)
    if body is None or too_deep(body):
        return None
    try:
        obj = json.loads(body, parse_constant=_no_constant)
    except (ValueError, RecursionError):  # JSONDecodeError, bad UTF-8, long integers, NaN; too deep
        return None
    return obj if isinstance(obj, dict) else None


def make_app(coord: RoundService, tokens: dict, fingerprint: str) -> FastAPI:
    """The FastAPI app serving one Coordinator (handlers' annotations must resolve at module level)."""
    app = FastAPI(title="plait federated server", docs_url=None, redoc_url=None, openapi_url=None)
    max_body = (coord.length + 1) * 8 * 2 + (1 << 20)
    _add_register(app, coord, tokens, fingerprint, max_body)
    _add_rounds(app, coord, tokens, max_body)
    _add_status(app, coord, tokens)
    return app


def _add_register(app: FastAPI, coord: RoundService, tokens: dict, fingerprint: str, max_body: int) -> None:
    @app.post("/v1/register")
    async def register(request: Request):
        if not authorized(tokens, request.headers.get("authorization"), None):  # before the body is read at all
            return _deny(401, "missing or wrong bearer token")
        obj = await _read_json(request, max_body)
        if obj is None or not isinstance(obj.get("client_id"), int) or isinstance(obj.get("client_id"), bool):
            return _deny(400, "body must be JSON with an integer client_id")
        cid = obj["client_id"]
        if not authorized(tokens, request.headers.get("authorization"), cid):
            return _deny(401, "missing or wrong bearer token")
        if not 0 <= cid < coord.fed.clients:
            return _deny(400, f"client_id {cid} is outside 0..{coord.fed.clients - 1}")
        if obj.get("fingerprint") != fingerprint:
            return _deny(409, "this client's config (model, data, partition, seed) differs from the server's; use the same file")
        raw_key = obj.get("public_key")
        if isinstance(raw_key, int) and not isinstance(raw_key, bool):
            raw_key = str(raw_key)
        if raw_key is not None and not (isinstance(raw_key, str) and raw_key.isascii() and raw_key.isdigit()
                                        and len(raw_key) <= 700):
            return _deny(400, "public_key must be a non-negative integer written as a decimal string")
        try:
            coord.register(cid, int(raw_key) if raw_key is not None else None)
        except ValueError as e:
            return _deny(400, f"registration refused: {e}")
        return {"accepted": True, "rounds": coord.fed.rounds}


def _add_rounds(app: FastAPI, coord: RoundService, tokens: dict, max_body: int) -> None:
    """A round's three calls: fetch the task, upload the update, send the seeds that unmask dropped peers."""

    @app.get("/v1/task")
    def task(request: Request):
        cid = _client_of(request)
        if cid is None or not authorized(tokens, request.headers.get("authorization"), cid):
            return _deny(401, "missing or wrong bearer token (or no client_id)")
        if cid not in coord.seen:
            return _deny(409, f"client {cid} has not registered")
        meta, weights = coord.task(cid)
        body = frame(meta, coord.weights_blob() if weights is not None else b"")
        return Response(body, media_type="application/octet-stream")

    @app.post("/v1/update")
    async def update(request: Request):
        cid = _client_of(request)
        if cid is None or not authorized(tokens, request.headers.get("authorization"), cid):
            return _deny(401, "missing or wrong bearer token (or no client_id)")
        try:
            rnd = int(request.query_params["round"])
        except (KeyError, ValueError):
            return _deny(400, "query parameter round must be an integer")
        body = await _read_body(request, max_body)
        if body is None:
            return _deny(413, f"upload larger than {max_body} bytes")
        try:
            tensors, meta = decode(body)
        except ValueError as e:
            return _deny(400, f"body is not a tensor message: {e}")
        ok, reason = await run_in_threadpool(coord.submit, cid, rnd, tensors, meta)
        return JSONResponse({"accepted": ok, "reason": reason}, status_code=200 if ok else 422)

    @app.post("/v1/unmask")
    async def unmask(request: Request):
        if not authorized(tokens, request.headers.get("authorization"), None):  # before the body is read at all
            return _deny(401, "missing or wrong bearer token")
        obj = await _read_json(request, max_body)
        cid = obj.get("client_id") if obj else None
        if not isinstance(cid, int) or not authorized(tokens, request.headers.get("authorization"), cid):
            return _deny(401, "missing or wrong bearer token (or no client_id)")
        seeds = obj.get("seeds")
        if not isinstance(seeds, dict) or not isinstance(obj.get("round"), int) or isinstance(obj.get("round"), bool):
            return _deny(400, "body must hold round (integer) and seeds (object)")
        ok, reason = coord.submit_unmask(cid, obj["round"], seeds)
        return JSONResponse({"accepted": ok, "reason": reason}, status_code=200 if ok else 422)


def _add_status(app: FastAPI, coord: RoundService, tokens: dict) -> None:
    @app.get("/v1/status")
    def status(request: Request):
        if not authorized(tokens, request.headers.get("authorization"), None):
            return _deny(401, "missing or wrong bearer token")
        return coord.status()


class HTTPServerThread:
    """uvicorn serving an app from a background thread (the round loop keeps the main thread)."""

    def __init__(self, app, host: str, port: int, ssl_certfile: str | None = None, ssl_keyfile: str | None = None):
        import uvicorn

        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile, lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="plait-fed-http", daemon=True)

    def start(self, timeout_s: float = 30.0) -> int:
        """Start serving; returns the bound port (useful with port 0)."""
        self.thread.start()
        end = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > end:
                raise FederatedError("the HTTP server did not start (is federated.port already in use?)")
            time.sleep(0.02)
        return self.server.servers[0].sockets[0].getsockname()[1]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


class FedHTTPClient:
    """The client's side of the protocol; connection problems are retried, then reported as FederatedError."""

    def __init__(self, server: str, token: str, ca_file: str | None = None, timeout_s: float = 30.0,
                 lost_after_s: float = 60.0):
        base = server if "://" in server else f"{'https' if ca_file else 'http'}://{server}"
        verify = ssl.create_default_context(cafile=ca_file) if ca_file else True
        self.http = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s, verify=verify)
        self.lost_after_s = lost_after_s
        self.base = base

    def close(self) -> None:
        self.http.close()

    def _call(self, method: str, path: str, retry_s: float | None = None, **kw) -> httpx.Response:
        budget = self.lost_after_s if retry_s is None else retry_s
        t0 = time.monotonic()
        said = None  # when the wait was last reported: a client started before its server says it is waiting
        while True:
            try:
                r = self.http.request(method, path, **kw)
            except httpx.TransportError as e:
                now = time.monotonic()
                if now - t0 > budget:
                    raise FederatedError(f"cannot reach the server at {self.base}: {e}") from None
                if said is None or now - said >= 10:
                    print(f"waiting for the server at {self.base} ({type(e).__name__}); retrying for up to "
                          f"{budget - (now - t0):.0f} s more", file=sys.stderr, flush=True)
                    said = now
                time.sleep(0.25)
                continue
            if r.status_code in (401, 409):
                raise FederatedError(f"server refused {path}: {r.json().get('reason', r.text)}")
            return r

    def register(self, client_id: int, public_key: int, fingerprint: str, connect_timeout_s: float) -> dict:
        r = self._call("POST", "/v1/register", retry_s=connect_timeout_s,
                       json={"client_id": client_id, "public_key": str(public_key), "fingerprint": fingerprint})
        if r.status_code != 200:
            raise FederatedError(f"registration refused: {r.text}")
        return r.json()

    def task(self, client_id: int) -> tuple[dict, Weights | None]:
        r = self._call("GET", "/v1/task", params={"client_id": client_id})
        if r.status_code != 200:
            raise FederatedError(f"task request refused: {r.text}")
        meta, blob = unframe(r.content)
        return meta, (decode(blob)[0] if meta.get("status") == "train" else None)

    def upload(self, client_id: int, rnd: int, tensors: Weights, meta: dict) -> tuple[bool, str]:
        r = self._call("POST", "/v1/update", params={"client_id": client_id, "round": rnd}, content=encode(tensors, meta),
                       headers={"content-type": "application/octet-stream"})
        body = r.json()
        return bool(body.get("accepted")), str(body.get("reason"))

    def unmask(self, client_id: int, rnd: int, seeds: dict[int, int]) -> tuple[bool, str]:
        r = self._call("POST", "/v1/unmask", json={"client_id": client_id, "round": rnd,
                                                  "seeds": {str(d): str(s) for d, s in seeds.items()}})
        body = r.json()
        return bool(body.get("accepted")), str(body.get("reason"))
