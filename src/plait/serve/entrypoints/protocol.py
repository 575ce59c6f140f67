"""The Open Inference Protocol (KServe v2) tensor codec: JSON tensors and the binary tensor data extension.

A request is a JSON header, optionally followed by raw little-endian tensor bytes; the
`Inference-Header-Content-Length` header says where the JSON ends (Triton's framing, which
`tritonclient.http` sends by default, with no Content-Type). Responses use the same framing
when the client asks for binary outputs. Everything a client can get wrong raises
`RequestError` with the HTTP status and a message that names the problem.

Bounds (docs/security.md): JSON is parsed strictly (no NaN/Infinity tokens; nesting deeper than
MAX_JSON_DEPTH is a 400, counted before parsing, whatever the interpreter's recursion limit); a
tensor has at most MAX_DIMS dimensions, each at most MAX_DIM; floating-point inputs must be finite
(NaN and Inf are refused with 400), and an answer whose floating-point outputs are not finite
cannot be sent as JSON (400, naming binary outputs as the way to get them), so every JSON body
plait sends is valid JSON. Before parsing, a body is counted (`check_items`): parsing holds the GIL, so
the event loop waits for it even on the codec thread, for a time that grows faster than the count of
arrays, and a body with more values and arrays than a request to the model can hold is a 413.
`encode_error` turns any exception into the error answer of every route.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from plait.jsondepth import _JSON_STRING, MAX_JSON_DEPTH, nesting_depth, too_deep  # noqa: F401 (re-exported)
from plait.serve.errors import RequestError, ServeError  # noqa: F401 (ServeError: encode_error's)
from plait.serve.model.signature import TensorSpec

orjson: ModuleType | None  # None when orjson is not installed
try:  # parses and writes JSON several times faster than the standard library (the request path's hot spot)
    import orjson
except ImportError:
    orjson = None

HEADER_LENGTH = "Inference-Header-Content-Length"

# KServe v2 datatypes that map onto fixed-size little-endian numpy types. BYTES and BF16 are not
# used by any plait model, so they are refused with a message rather than half-supported.
DATATYPES: dict[str, np.dtype] = {
    name: np.dtype(t).newbyteorder("<")
    for name, t in {
        "BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
        "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
        "FP16": np.float16, "FP32": np.float32, "FP64": np.float64,
    }.items()
}
NUMPY_TO_DATATYPE = {np.dtype(v).newbyteorder("="): k for k, v in DATATYPES.items()}
MAX_DIMS = 32  # dimensions of one tensor (numpy's own limit is 64)
MAX_DIM = 1 << 31  # size of one dimension


@dataclass
class InferRequest:
    """A decoded infer request: its input arrays by name and how each output should come back."""

    inputs: dict[str, np.ndarray]
    datatypes: dict[str, str]
    id: str | None = None
    outputs: list[str] | None = None  # None: every output
    binary: dict[str, bool] = field(default_factory=dict)  # per requested output
    binary_default: bool = False
    parameters: dict = field(default_factory=dict)


def _bad(message: str) -> RequestError:
    return RequestError(400, message)


def short(v, limit: int = 40) -> str:
    """A JSON value for an error message: short, and never a deep structure's text."""
    if isinstance(v, dict):
        return "a JSON object"
    if isinstance(v, list):
        if any(isinstance(x, (list, dict)) for x in v[:limit]):
            return "a nested JSON array"
        v = v[:limit]
    try:
        text = json.dumps(v)
    except ValueError:
        text = repr(v)
    return text if len(text) <= limit else text[:limit - 3] + "..."


CHUNK = 1 << 16  # values converted per step: long conversions hand the GIL back between steps (the event loop runs)


def _types(values: list) -> set:
    out: set = set()
    for i in range(0, len(values), CHUNK):
        out |= set(map(type, values[i:i + CHUNK]))
    return out


def _flatten(name: str, data) -> tuple[list, set]:
    """The values of a (possibly nested) JSON array in order and their types, without recursion; nesting is bounded."""
    if not isinstance(data, list):
        return [data], {type(data)}
    types = _types(data)
    if list not in types:
        return data, types
    out: list = []
    stack = [iter(data)]
    while stack:
        for v in stack[-1]:
            if isinstance(v, list):
                if len(stack) >= MAX_DIMS:
                    raise _bad(f"input '{name}': data is nested more than {MAX_DIMS} levels deep")
                stack.append(iter(v))
                break
            out.append(v)
        else:
            stack.pop()
    return out, _types(out)


def _json_values(name: str, datatype: str, data) -> np.ndarray:
    """The flat (or nested) JSON `data` of a tensor as a numpy array of its datatype."""
    flat, types = _flatten(name, data)
    allowed: set[type]
    if datatype == "BOOL":
        allowed, kind = {bool}, "true/false"
    elif datatype.startswith(("INT", "UINT")):
        allowed, kind = {int}, "integers"
    else:
        allowed, kind = {int, float}, "numbers"
    if not types <= allowed:  # type(True) is bool, so booleans are not numbers here
        bad = next(v for v in flat if type(v) not in allowed)
        raise _bad(f"input '{name}': data must hold {kind} for datatype {datatype}, found {short(bad)}")
    arr = np.empty(len(flat), dtype=DATATYPES[datatype])
    try:
        with np.errstate(over="ignore"):
            for i in range(0, len(flat), CHUNK):
                arr[i:i + CHUNK] = flat[i:i + CHUNK]
    except (OverflowError, ValueError) as e:
        raise _bad(f"input '{name}': a value does not fit datatype {datatype} ({e})") from None
    return arr


def _finite(name: str, datatype: str, arr: np.ndarray) -> None:
    if datatype.startswith("FP") and not bool(np.isfinite(arr).all()):
        raise _bad(f"input '{name}' holds NaN or Inf (or a value too large for {datatype}); inputs must be finite")


def _shape(name: str, shape) -> tuple[int, ...]:
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise _bad(f"input '{name}': shape must be a list of non-negative integers, got {short(shape, 80)}")
    if len(shape) > MAX_DIMS:
        raise _bad(f"input '{name}': shape has {len(shape)} dimensions; at most {MAX_DIMS} are supported")
    if any(d > MAX_DIM for d in shape) or math.prod(d for d in shape if d) > MAX_DIM * MAX_DIM:
        raise _bad(f"input '{name}': shape {short(shape, 80)} is too large (at most {MAX_DIM} per dimension, and not "
                   f"more than {MAX_DIM * MAX_DIM} elements)")
    return tuple(shape)


def _no_constant(token: str):
    raise ValueError(f"{token} is not a JSON value (numbers must be finite)")


ORJSON_MAX_OPENINGS = 512  # more '[' and '{' than this (a nested tensor, a hostile body): the standard library parses
_LONG_DIGITS = re.compile(rb"[0-9]{19}")  # a number with 19 digits in a row may be an integer beyond 64 bits

# Arrays and objects open at once, at most. The standard library's parser recurses once per level, so without a
# bound of its own the deepest body it reads depends on sys.getrecursionlimit() (which hypothesis and torch._dynamo
# raise) and on how deep the caller's stack is. 512 leaves room under the default limit of 1000 for any caller's
# stack, and is far above what a request needs (a tensor nests MAX_DIMS levels inside 3 of the request's).
_too_deep = too_deep


def _orjson_agrees(data: bytes) -> bool:
    """Whether orjson's reading of `data` is the standard library's (cheap checks on the raw bytes, in C)."""
    return data.count(b"[") + data.count(b"{") < ORJSON_MAX_OPENINGS and _LONG_DIGITS.search(data) is None


def loads(data: bytes | str, what: str = "request body"):
    """Strict JSON (no NaN/Infinity; at most MAX_JSON_DEPTH levels deep): anything else is a 400 naming the problem."""
    if orjson is not None and isinstance(data, bytes) and _orjson_agrees(data):
        # orjson accepts a subset of what the standard library does (UTF-8 only, no NaN, no lone surrogates), with
        # the same values, once nesting stays under MAX_JSON_DEPTH and no integer can be wider than 64 bits
        # (orjson would read it as a float); whatever it refuses goes to the standard library, which accepts it or
        # names the problem: the answer is always the standard library's.
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    if _too_deep(data):
        raise _bad(f"{what} is nested too deeply to be parsed")
    try:
        return json.loads(data, parse_constant=_no_constant)
    except RecursionError:  # a caller that lowered the recursion limit below MAX_JSON_DEPTH
        raise _bad(f"{what} is nested too deeply to be parsed") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, integers over 4300 digits, NaN/Infinity
        raise _bad(f"{what} is not valid JSON: {str(e)[:200]}") from None


# Arrays and objects in one body at most when the model's inputs do not bound them (a free dimension past the batch
# one): 65,536 parse in ~7 ms, 2^18 in ~180 ms, 5 M (15 MB of `[]`) in ~3 s, the GIL held all along.
MAX_JSON_CONTAINERS = 1 << 16


def _items(data: bytes, values: bool, end: int) -> int:
    n = data.count(b"[", 0, end) + data.count(b"{", 0, end)
    return n + data.count(b",", 0, end) if values else n


def check_items(data: bytes, max_items: int | None, hint: str = "", what: str = "request body") -> None:
    """413 before parsing when `data` holds more than `max_items` values, arrays and objects (commas + openings: at
    least as many as there are), or, `max_items` None, more than MAX_JSON_CONTAINERS arrays and objects.

    Counted in C over a prefix that doubles until the count passes the limit (a hostile body is refused after its
    first few KB), then again without the strings' text (brackets and commas inside strings are not structure)."""
    values = max_items is not None
    limit = max_items if max_items is not None else MAX_JSON_CONTAINERS
    end = min(len(data), 4 * limit + 64)
    while _items(data, values, end) <= limit:
        if end == len(data):
            return
        end = min(len(data), 2 * end)
    bare = _JSON_STRING.sub(b"", data[:end])  # a string cut at `end` runs to it: the prefix's structure, exactly
    if _items(bare, values, len(bare)) <= limit:  # strings inflated the count: the whole body's structure decides
        bare = _JSON_STRING.sub(b"", data)
        if _items(bare, values, len(bare)) <= limit:
            return
    if values:
        raise RequestError(413, f"{what} holds more than {limit} JSON values, arrays and objects, the most a request "
                                f"here holds{hint}")
    raise RequestError(413, f"{what} holds more than {limit} JSON arrays and objects, the most that are read: send "
                            "tensor data flat (row-major) or as binary data")


def decode_infer_request(body: bytes, header_length: str | None, max_items: int | None = None,
                         hint: str = "") -> InferRequest:
    """Parse an infer request body (JSON, or JSON + binary tensor data); `max_items`: see check_items."""
    head, binary = _split_body(body, header_length)
    check_items(head, max_items, hint)
    obj = loads(head)
    req, inputs = _request_head(obj)
    offset = 0
    for i, t in enumerate(inputs):
        name, datatype, arr, offset = _decode_input(i, t, req.inputs, binary, offset)
        req.inputs[name] = arr
        req.datatypes[name] = datatype
    if offset != len(binary):
        raise _bad(f"the body has {len(binary) - offset} bytes after the tensor data that the inputs declare")
    _output_choices(req, obj.get("outputs"))
    return req


def _split_body(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    """The JSON header and the binary tensor data after it (Triton's framing; no header length: all JSON)."""
    if header_length is None:
        return body, memoryview(b"")
    try:
        n = int(header_length)
    except ValueError:
        raise _bad(f"{HEADER_LENGTH} = {header_length!r} is not an integer") from None
    if not 0 < n <= len(body):
        raise _bad(f"{HEADER_LENGTH} = {n} but the body has {len(body)} bytes; it must be between 1 and the body size")
    return body[:n], memoryview(body)[n:]


def _request_head(req) -> tuple[InferRequest, list]:
    """The request's id and parameters (its inputs still to decode), and the list of its input tensors."""
    if not isinstance(req, dict):
        raise _bad(f"request body must be a JSON object with 'inputs', got {type(req).__name__}")
    inputs = req.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise _bad("request must have 'inputs': a non-empty list of tensors {name, shape, datatype, data}")
    params = req.get("parameters") or {}
    if not isinstance(params, dict):
        raise _bad("'parameters' must be a JSON object")
    out = InferRequest(inputs={}, datatypes={}, id=None, parameters=params)
    if "id" in req:
        if not isinstance(req["id"], str):
            raise _bad("'id' must be a string")
        out.id = req["id"]
    return out, inputs


def _decode_input(i: int, t, seen: dict, binary: memoryview, offset: int) -> tuple[str, str, np.ndarray, int]:
    """inputs[i]: its name, datatype and array, and where the next input's binary data starts."""
    if not isinstance(t, dict) or not isinstance(t.get("name"), str):
        raise _bad(f"inputs[{i}] must be an object with a string 'name'")
    name = t["name"]
    if name in seen:
        raise _bad(f"input '{name}' is given twice")
    datatype = t.get("datatype")
    if not isinstance(datatype, str) or datatype not in DATATYPES:
        raise _bad(f"input '{name}': datatype {short(datatype)} is not supported; use one of {', '.join(DATATYPES)}")
    shape = _shape(name, t.get("shape"))
    tparams = t.get("parameters") or {}
    if not isinstance(tparams, dict):
        raise _bad(f"input '{name}': 'parameters' must be a JSON object")
    size = tparams.get("binary_data_size")
    if size is not None:
        arr = _binary_input(name, datatype, shape, size, binary[offset:])
        offset += size
    elif "data" in t:
        arr = _json_values(name, datatype, t["data"])
        if arr.size != math.prod(shape):
            raise _bad(f"input '{name}': data has {arr.size} values but shape {list(shape)} needs {math.prod(shape)}")
        _finite(name, datatype, arr)
    else:
        raise _bad(f"input '{name}' has neither 'data' nor parameters.binary_data_size")
    return name, datatype, arr.reshape(shape), offset


def _binary_input(name: str, datatype: str, shape: tuple[int, ...], size, rest: memoryview) -> np.ndarray:
    """An input's `size` bytes of binary tensor data from the start of `rest` (the data not yet taken)."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise _bad(f"input '{name}': binary_data_size must be a non-negative integer")
    want = math.prod(shape) * DATATYPES[datatype].itemsize
    if size != want:
        raise _bad(f"input '{name}': binary_data_size is {size} bytes but shape {list(shape)} of {datatype} "
                   f"needs {want}")
    if size > len(rest):
        raise _bad(f"input '{name}': the body holds {len(rest)} bytes of tensor data after the JSON "
                   f"header, {size} are declared")
    arr = np.frombuffer(rest[:size], dtype=DATATYPES[datatype])
    _finite(name, datatype, arr)
    return arr


def _output_choices(req: InferRequest, outputs) -> None:
    """Which outputs the request asks for (None: all) and which of them come back as binary data."""
    default = req.parameters.get("binary_data_output", False)
    if not isinstance(default, bool):
        raise _bad("parameters.binary_data_output must be true or false")
    req.binary_default = default
    if outputs is None:
        return
    if not isinstance(outputs, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str) for o in outputs):
        raise _bad("'outputs' must be a list of objects with a string 'name'")
    req.outputs = []
    for o in outputs:
        oparams = o.get("parameters") or {}
        if not isinstance(oparams, dict):
            raise _bad(f"output '{o['name']}': 'parameters' must be a JSON object")
        binary_flag = oparams.get("binary_data", default)
        if not isinstance(binary_flag, bool):
            raise _bad(f"output '{o['name']}': parameters.binary_data must be true or false")
        req.outputs.append(o["name"])
        req.binary[o["name"]] = binary_flag


def check_inputs(req: InferRequest, model_name: str, specs: list[TensorSpec], max_rows: int) -> int:
    """Check names, datatypes and shapes against the model's inputs; returns the request's batch size."""
    wanted = {s.name: s for s in specs}
    takes = ", ".join(s.describe() for s in specs)
    for name in req.inputs:
        if name not in wanted:
            raise _bad(f"unknown input '{name}'; model '{model_name}' takes: {takes}")
    rows = None
    for spec in specs:
        if spec.name not in req.inputs:
            raise _bad(f"missing input '{spec.name}'; model '{model_name}' takes: {takes}")
        arr, dt = req.inputs[spec.name], req.datatypes[spec.name]
        if dt != spec.datatype:
            raise _bad(f"input '{spec.name}' has datatype {dt} but model '{model_name}' expects {spec.datatype}")
        ok = len(arr.shape) == len(spec.shape) and all(w in (-1, d) for w, d in zip(spec.shape, arr.shape))
        if not ok:
            raise _bad(f"input '{spec.name}' has shape {list(arr.shape)} but model '{model_name}' expects "
                       f"{list(spec.shape)} (-1: any size)")
        if any(d == 0 for d in arr.shape):
            raise _bad(f"input '{spec.name}' has shape {list(arr.shape)}: every dimension must be at least 1")
        if rows is not None and arr.shape[0] != rows:
            raise _bad(f"inputs disagree on the batch size: '{spec.name}' has {arr.shape[0]} rows, others {rows}")
        rows = arr.shape[0]
    assert rows is not None
    if rows > max_rows:
        raise _bad(f"the request has batch size {rows} but max_batch_size is {max_rows}; split it into smaller requests")
    return rows


def encode_infer_response(model_name: str, req: InferRequest, outputs: dict[str, np.ndarray],
                          specs: list[TensorSpec]) -> tuple[bytes, dict[str, str]]:
    """The response body and its headers: JSON, or JSON + binary when any output is asked for as binary."""
    names = req.outputs if req.outputs is not None else [s.name for s in specs]
    known = {s.name: s for s in specs}
    for n in names:
        if n not in known:
            raise _bad(f"unknown output '{n}'; model '{model_name}' has: {', '.join(known)}")
    head: dict = {"model_name": model_name, "model_version": "1", "outputs": []}
    if req.id is not None:
        head["id"] = req.id
    chunks: list[bytes] = []
    for n in names:
        arr = np.ascontiguousarray(outputs[n], dtype=DATATYPES[known[n].datatype])
        t: dict[str, Any] = {"name": n, "datatype": known[n].datatype, "shape": list(arr.shape)}
        if req.binary.get(n, req.binary_default):
            raw = arr.tobytes()
            t["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            if arr.dtype.kind == "f" and not bool(np.isfinite(arr).all()):
                raise _not_finite()
            t["data"] = arr.reshape(-1).tolist()
        head["outputs"].append(t)
    text = dumps(head)
    if not chunks:
        return text, {"content-type": "application/json"}
    return text + b"".join(chunks), {"content-type": "application/octet-stream", HEADER_LENGTH.lower(): str(len(text))}


def _not_finite() -> RequestError:
    return _bad("the model's output for this input holds NaN or Inf, which JSON cannot carry; ask for the outputs as "
                "binary data (parameters.binary_data_output = true) to get the raw values")


def error_body(message: str) -> bytes:
    """KServe v2 error object (tritonclient reads its 'error' field). ASCII-escaped: a message that quotes a client's
    lone surrogate (which the standard library's parser lets in) still encodes."""
    return json.dumps({"error": message}).encode()


def encode_error(e: Exception) -> tuple[int, bytes, dict[str, str]]:
    """The HTTP answer to an exception raised while serving a request: status, body and headers.

    The one encoder of both infer entry points (the middleware's fast path and the framework's routes) and of
    every other route: a RequestError answers with its status and message (a 503 adds Retry-After: come back in a
    second; a 408 or 431 closes the connection); anything else is a 500 that names the exception (a bug of the
    server, never of the request)."""
    if isinstance(e, RequestError):
        status, message = e.status, str(e)
    else:
        status, message = 500, f"internal error: {type(e).__name__}: {e}"
    headers = {"content-type": "application/json"}
    if status == 503:
        headers["retry-after"] = "1"
    elif status in (408, 431):  # a client too slow to send its body, or a head too large: its connection is closed
        headers["connection"] = "close"
    return status, error_body(message), headers


def dumps(obj) -> bytes:
    """Compact JSON bytes of a structure whose floats are finite (the caller checks: orjson would write NaN as null).
    A string orjson cannot write (a lone surrogate, which the standard library's parser lets in) goes the standard
    library's way, escaped."""
    if orjson is not None:
        try:
            return orjson.dumps(obj)
        except orjson.JSONEncodeError:
            pass
    try:
        return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    except ValueError:
        raise _not_finite() from None
