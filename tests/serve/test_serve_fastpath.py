"""The faster request path: orjson reads what the standard library reads (or hands over), uvloop + httptools, head bound."""

import json
import math
import socket
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.serve.entrypoints import protocol
from plait.serve.entrypoints.protocol import loads
from plait.serve.entrypoints.server import MAX_HEAD_BYTES, ServerThread, loop_and_protocol
from plait.serve.errors import RequestError
from plait.serve.service import ServeOptions
from serve_helpers import mlp_run  # noqa: F401

pytest.importorskip("orjson")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**25), 10**25) | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner, max_size=5), max_leaves=30)


def std(data: bytes):
    """The standard library's answer, under the protocol's own depth bound: nesting deeper than MAX_JSON_DEPTH is
    refused whatever sys.getrecursionlimit() is (earlier tests in this process may have raised it)."""
    if protocol.nesting_depth(data) > protocol.MAX_JSON_DEPTH:
        return ("error", "too deep")
    try:
        return ("ok", json.loads(data, parse_constant=protocol._no_constant))
    except (ValueError, RecursionError) as e:
        return ("error", type(e).__name__)


def same(a, b) -> bool:
    """Equal values of equal types (1 and 1.0 differ here; -0.0 and 0.0 too)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


@settings(max_examples=300, deadline=None)
@given(value=json_values, ascii_only=st.booleans())
def test_loads_reads_what_the_standard_library_reads(value, ascii_only):
    data = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert same(loads(data), json.loads(data))


@pytest.mark.parametrize("data", [b"[" * 1000 + b"]" * 1000, b"[" + str(10**30).encode() + b"]", b"[-0]", b"[1E400]",
                                  b'["\\ud800"]', b"[NaN]", b"\xef\xbb\xbf[1]", '[1]'.encode("utf-16"), b"[1,]"])
def test_edge_cases_get_the_standard_librarys_answer(data):
    kind, want = std(data)
    if kind == "ok":
        assert same(loads(data), want)
    else:
        with pytest.raises(RequestError):
            loads(data)


@pytest.mark.parametrize("limit", [1000, 100_000])  # the default; what hypothesis and torch._dynamo raise it to
def test_the_depth_bound_does_not_depend_on_the_recursion_limit(limit):
    """A 1000-deep body parsed once an earlier test had raised the recursion limit: the bound is counted instead."""
    deep = protocol.MAX_JSON_DEPTH
    bound = b"[" * deep + b"]" * deep
    before = sys.getrecursionlimit()
    try:
        sys.setrecursionlimit(limit)
        for data in (b"[" * 1000 + b"]" * 1000, b"[" * (deep + 1) + b"]" * (deep + 1), b'{"a": ' + bound + b"}"):
            with pytest.raises(RequestError, match=r"^request body is nested too deeply to be parsed$"):
                loads(data)
        value, levels = loads(bound), 1
        while value:
            value, levels = value[0], levels + 1
        assert levels == deep == protocol.nesting_depth(bound) == 512
        text = b'["' + b"[{" * 5000 + b'\\"]", "\\\\", "]]"]'  # brackets in strings are text, escapes included
        assert protocol.nesting_depth(text) == 1 and loads(text) == ["[{" * 5000 + '"]', "\\", "]]"]
    finally:
        sys.setrecursionlimit(before)


def test_the_depth_scan_is_linear_on_a_hostile_body():
    """An unterminated string of escaped quotes (every quote a place a string could start) is scanned once."""
    body = b"[" * 600 + b'"' + b'\\"' * 2_000_000 + b"\\"
    t0 = time.perf_counter()
    assert protocol.nesting_depth(body) == 600
    assert time.perf_counter() - t0 < 2.0  # 0.05 s here; a scan that restarts at each quote takes hours


def test_the_fast_loop_and_parser_serve_and_a_huge_head_is_cut(mlp_run):  # noqa: F811
    assert loop_and_protocol() == "uvloop + HttpToolsProtocol"
    with ServerThread(mlp_run, ServeOptions()) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:  # < the 10 s head deadline
            s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(1024).startswith(b"HTTP/1.1 200")
            s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * (MAX_HEAD_BYTES + 1024))
            try:  # closed by the server at once: end of file (or a reset, the pad being unread)
                while s.recv(65536):
                    pass
            except ConnectionResetError:
                pass
