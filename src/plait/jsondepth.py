"""How deeply a JSON text nests, counted before it is parsed: a body nested deeper than MAX_JSON_DEPTH is refused
whatever the interpreter's recursion limit (which a library may raise: the parser would then accept it, or another
process's tests would see another answer). Used by the serving protocol and the federated server."""

from __future__ import annotations

import re

MAX_JSON_DEPTH = 512
# A string, escapes included (its brackets are text). It always matches from a quote to the closing quote or to the
# end of the data (an unterminated string), so the scan stays linear whatever the body holds.
_JSON_STRING = re.compile(rb'"[^"\\]*+(?:\\(?:.|\Z)[^"\\]*+)*+(?:"|\Z)', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def nesting_depth(data: bytes | str) -> int:
    """The most arrays and objects open at once in `data` (brackets inside strings do not count): a scan in C and
    numpy, without parsing. Malformed JSON gets a number too; the parser names what is wrong with it."""
    import numpy as np  # here: the CLI imports this module's users and needs no numpy

    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    step = np.zeros(256, dtype=np.int8)
    step[[ord("["), ord("{")]], step[[ord("]"), ord("}")]] = 1, -1
    return int(np.cumsum(step[np.frombuffer(brackets, dtype=np.uint8)], dtype=np.int64).max(initial=0))


def too_deep(data: bytes | str) -> bool:
    """Whether `data` nests arrays and objects deeper than MAX_JSON_DEPTH."""
    if isinstance(data, bytes):
        openings = data.count(b"[") + data.count(b"{")
    else:
        openings = data.count("[") + data.count("{")
    return openings > MAX_JSON_DEPTH and nesting_depth(data) > MAX_JSON_DEPTH  # fewer openings cannot nest deeper
