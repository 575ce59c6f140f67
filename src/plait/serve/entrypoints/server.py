"""Run a Service on uvicorn: from the CLI (signals, graceful shutdown) or on a background thread (tests, benchmarks).

The service's workers start before uvicorn accepts connections, so a model that cannot load
is a one-line error, and stop after uvicorn has finished the requests in flight: on SIGTERM
uvicorn stops listening, lets running requests complete (the batcher keeps cutting batches
for them), and only then are the batcher and the worker processes shut down.

Connections (docs/security.md): a request's head must arrive within --read-timeout-s of its first
byte (or of the connection opening), else the connection is closed (its body too: plait.serve.entrypoints.app);
at most --max-connections are open at once. Past them RESERVE_CONNECTIONS more are taken, each for one
request to the health probes or /metrics (anything else: 503), with a head deadline of at most
RESERVE_HEAD_S, then closed: clients that hold every slot do not make the server look dead. One more
is closed as soon as it is accepted. uvicorn has none of these, so they live in a subclass of its HTTP
protocol (`guarded_protocol`); its own keep-alive timeout closes idle connections. A head that passes
MAX_HEAD_BYTES while it arrives gets 431 and the connection is closed (h11 has such a limit, httptools
none); one that comes whole in one read is answered 431 by the app.

The loop and the parser are the fast ones when installed (uvloop, httptools: `loop_and_protocol()`),
as uvicorn's "auto" would choose; asyncio's own loop and h11 otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import uvicorn

if TYPE_CHECKING:  # each of these is one of two unrelated objects below: declared as what the two have in common
    _HTTPBase: type[asyncio.Protocol]
    _new_loop: Callable[[], asyncio.AbstractEventLoop]

try:  # the protocol uvicorn's "auto" would choose
    import httptools  # noqa: F401
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _HTTPBase
except ImportError:
    from uvicorn.protocols.http.h11_impl import H11Protocol as _HTTPBase

try:  # the event loop uvicorn's "auto" would choose (asyncio.run would not: it always makes asyncio's own)
    import uvloop

    _new_loop = uvloop.new_event_loop
except ImportError:
    _new_loop = asyncio.new_event_loop

from plait.serve.engine.core import on_passing_thread
from plait.serve.entrypoints.app import MAX_HEAD_BYTES, OPEN_PATHS, create_app
from plait.serve.entrypoints.protocol import encode_error
from plait.serve.errors import RequestError, ServeError
from plait.serve.model.load import ModelRef, freeze_loaded, load_model
from plait.serve.model.quantize import accuracy_change
from plait.serve.service import ServeOptions, Service

GRACEFUL_S = 30  # how long in-flight requests may take to finish after SIGTERM
RESERVE_CONNECTIONS = 8  # past --max-connections: connections for one health or metrics request each
RESERVE_HEAD_S = 2.0  # a reserve connection's head deadline (at most --read-timeout-s)
RESERVE_PATHS = (*OPEN_PATHS, "/metrics")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, or a one-line error when the address is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets that say so, and without it every
    # response written in two parts (head, body) waits ~40 ms for the client's delayed ACK (Nagle).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ServeError(f"{host}:{port} is already in use; pass another --port (or stop what listens there)") from None
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror}; check --host and --port") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT once it has shut down, which would kill the process before the
    service's worker processes are stopped; here the signal only asks for the graceful stop."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


if TYPE_CHECKING:
    class _Cycle(Protocol):
        response_complete: bool

    class _HTTPProtocol(asyncio.Protocol):
        """What _Guarded uses of the uvicorn class it is mixed into (HttpToolsProtocol and H11Protocol both have
        these attributes, each with its own request cycle class)."""

        app: Callable
        connections: set[asyncio.Protocol]
        cycle: _Cycle | None
        loop: asyncio.AbstractEventLoop
        transport: asyncio.Transport
else:
    _HTTPProtocol = object  # at run time a plain mixin: uvicorn's class follows it in the MRO (guarded_protocol)


def _raw_error(e: RequestError) -> bytes:
    """A whole HTTP/1.1 error answer that closes the connection (written by the protocol, no app involved)."""
    status, body, headers = encode_error(e)
    head = [f"HTTP/1.1 {status} {'Request Header Fields Too Large' if status == 431 else 'Error'}"]
    head += [f"{k}: {v}" for k, v in (headers | {"connection": "close", "content-length": str(len(body))}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def reserved_only(app):
    """`app` for a reserve connection: GET of a health probe or /metrics, once (the answer closes the connection);
    anything else is a 503 that says why."""
    refusal = RequestError(503, "every connection slot is taken (--max-connections); this spare connection answers "
                                f"only GET {', '.join(RESERVE_PATHS)}")

    async def reserved(scope, receive, send):
        async def closing(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        if scope["type"] == "http" and scope["method"] == "GET" and scope["path"] in RESERVE_PATHS:
            return await app(scope, receive, closing)
        status, body, headers = encode_error(refusal)
        raw = [(k.encode(), v.encode()) for k, v in (headers | {"connection": "close"}).items()]
        await send({"type": "http.response.start", "status": status,
                    "headers": raw + [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    return reserved


class _Guarded(_HTTPProtocol):
    """Mixin for uvicorn's HTTP protocol classes: a deadline for each request head, a cap on open connections and a
    few reserve connections past it for the health probes."""

    head_timeout_s: float = 10.0
    max_connections: int = 256
    reserve: set  # the reserve connections open now (one set per server: guarded_protocol)

    def connection_made(self, transport) -> None:
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._timeout_s = self.head_timeout_s
        super().connection_made(transport)
        if len(self.connections) - len(self.reserve) > self.max_connections:
            if len(self.reserve) >= RESERVE_CONNECTIONS:
                transport.close()  # uvicorn's connection_lost forgets it
                return
            self.reserve.add(self)
            self.app = reserved_only(self.app)
            self._timeout_s = min(RESERVE_HEAD_S, self.head_timeout_s)
        self._arm()

    def _waiting_for_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self._timeout_s, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self._waiting_for_head() and not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._waiting_for_head():
            self._arm()
        super().data_received(data)
        if not self._waiting_for_head():
            self._disarm()
            self._head_bytes = 0
        else:  # all of it is (part of) a head
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                self.transport.write(_raw_error(RequestError(431, f"the request head is over {MAX_HEAD_BYTES} bytes")))
                self.transport.close()

    def connection_lost(self, exc) -> None:
        self._disarm()
        self.reserve.discard(self)
        super().connection_lost(exc)


def guarded_protocol(head_timeout_s: float, max_connections: int) -> type:
    """uvicorn's HTTP protocol (httptools when installed, else h11) with the head deadline, the connection cap and its
    reserve."""
    base = _HTTPBase
    return type(f"Guarded{base.__name__}", (_Guarded, base),
                {"head_timeout_s": head_timeout_s, "max_connections": max_connections, "reserve": set()})


def uvicorn_server(service: Service) -> uvicorn.Server:
    o = service.opts
    config = uvicorn.Config(create_app(service), log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=GRACEFUL_S, timeout_keep_alive=30,
                            http=guarded_protocol(o.read_timeout_s, o.max_connections))
    return _Server(config)


async def serve_async(service: Service, server: uvicorn.Server, sock: socket.socket, on_started=None) -> None:
    await service.start()
    if on_started is not None:
        on_started()
    try:
        await server.serve(sockets=[sock])
    finally:
        await service.stop()


def run_loop(main) -> None:
    """asyncio.run(main) on uvloop when it is installed (its loop costs the request path less than asyncio's)."""
    with asyncio.Runner(loop_factory=_new_loop) as runner:
        runner.run(main)


def loop_and_protocol() -> str:
    return f"{'uvloop' if _new_loop is not asyncio.new_event_loop else 'asyncio'} + {_HTTPBase.__name__}"


def banner_lines(service: Service, url: str) -> list[str]:
    """What `plait serve` prints once it answers: the model, how it runs (the engine's settings, or the batcher's),
    and every route it serves."""
    s, opts, engine = service.served, service.opts, service.engine
    head = (f"serving '{service.name}' ({s.registry_name}, {s.spec.task}, checkpoint {s.checkpoint or '-'}) at {url} · "
            f"{service.layout} on {service.device}" + (" · bearer token required" if opts.token else ""))
    if engine is not None or service.remote_engine:
        c = opts.engine_config
        where = (f"KV cache {engine.pool.num_blocks} blocks x {c.block_size} tokens ({opts.kv_cache_mb:g} MB)"
                 if engine is not None else f"in each of {opts.replicas} replicas ({opts.route} routing), KV cache "
                                            f"{opts.kv_cache_mb:g} MB of {c.block_size}-token blocks")
        how = (f"  engine: continuous batching · {where} · max {c.max_seqs} sequences, {c.max_prefill_tokens} prompt "
               f"tokens a step · prefix caching {'on' if c.prefix_caching else 'off'} · context "
               f"{opts.max_model_len or s.context} tokens"
               + (f" · draft {opts.draft} ({opts.num_speculative_tokens} tokens a step)" if opts.draft else "")
               + (f" · LoRA adapters: {', '.join(service.adapters)}" if service.adapters else "")
               + (f" · tensor parallel over {opts.tp} processes" if opts.tp > 1 else "")
               + (f" · blocks split over {opts.pp} pipeline stages" if opts.pp > 1 else ""))
    else:
        how = (f"  batching: max {opts.max_batch_size} rows / {opts.max_delay_ms:g} ms, queue {opts.max_queue}, timeout "
               f"{opts.timeout_ms:g} ms" + service.exactness)
    routes = [f"{url}/v2/models/{service.name}/infer"] + ([f"{url}/v1/generate"] if s.can_generate else [])
    if engine is not None or service.remote_engine:
        routes += [f"{url}/v1/completions", f"{url}/v1/chat/completions", f"{url}/v1/models", f"{url}/tokenize",
                   f"{url}/detokenize"]
    return [head, how, "  " + "  ·  ".join(routes + [f"{url}/metrics", f"{url}/docs"])]


def run(path: str, opts: ServeOptions) -> int:
    """`plait serve`: load, print what is served, answer until SIGINT/SIGTERM."""
    sock = bind(opts.host, opts.port)
    try:
        if opts.replicas == 1 and opts.pp == 1:
            import torch

            torch.set_num_threads(opts.threads_per(1, in_process=True))
        # built on a passing thread: this one then holds no OpenMP team beside the engine's (on_passing_thread)
        service = on_passing_thread(Service, path, opts)
        if service.engine is not None and service.tp_group is None and service.pp_group is None:
            # The engine's thread keeps its own count (Engine._loop); this thread's torch calls are the event loop's
            # small ones, which need no OpenMP team of their own spinning beside the engine's threads.
            torch.set_num_threads(1)
        s = service.served
        if opts.quantize:
            fp32 = load_model(ModelRef(path, None, opts.trust_factory, opts.trust_checkpoint)).module
            print(accuracy_change(fp32, s.module, s, path), flush=True)
        host, port = sock.getsockname()[:2]
        url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        print(f"{service.layout}: starting", flush=True)

        def banner() -> None:  # once the workers are up: whoever reads it may send requests
            print("\n".join(banner_lines(service, url)), flush=True)

        freeze_loaded()  # this process's loaded heap, out of the collector's full passes (their pauses stall streams)

        run_loop(serve_async(service, uvicorn_server(service), sock, banner))
    finally:
        sock.close()
    print("plait serve: stopped", file=sys.stderr, flush=True)
    return 0


class ServerThread:
    """A Service on uvicorn in a background thread, on a free loopback port (tests and benchmarks).

        with ServerThread(path, ServeOptions(max_batch_size=8)) as srv:
            httpx.get(srv.url + "/v2/health/ready")
    """

    def __init__(self, path: str, opts: ServeOptions | None = None, service: Service | None = None,
                 start_timeout_s: float = 120.0):
        self.service = service or Service(str(path), opts or ServeOptions())
        opts = self.service.opts
        self.sock = bind(opts.host, 0)  # always a free port: tests and benchmarks run side by side
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{opts.host}:{self.port}"
        self.server = uvicorn_server(self.service)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="plait-serve", daemon=True)
        self._timeout = start_timeout_s

    def _main(self) -> None:
        try:
            run_loop(serve_async(self.service, self.server, self.sock))
        except BaseException as e:  # surfaced by start() / stop()
            self._error = e

    def start(self) -> ServerThread:
        self._thread.start()
        # uvicorn sets `started` once it accepts connections; a failed start ends the thread.
        tick = threading.Event()
        waited = 0.0
        while not self.server.started and self._thread.is_alive() and waited < self._timeout:
            tick.wait(0.02)
            waited += 0.02
        if not self.server.started:
            self.stop()
            raise RuntimeError(f"server did not start: {self._error!r}")
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)
        self.sock.close()
        if self._thread.is_alive():
            raise RuntimeError("server thread did not stop")
        if self._error is not None and not isinstance(self._error, (KeyboardInterrupt, SystemExit)):
            raise self._error

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
