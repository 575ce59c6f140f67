""".pt2 archives read as data: what `torch.export.load` would run, refused before torch opens the file.

A .pt2 is a zip that torch reads with several ways to run code from the file: a weight or constant whose payload
config says `use_pickle` goes to `torch.load(weights_only=False)`; custom and opaque constants to torchbind's and
Python's unpicklers; the sample inputs fall back to `torch.load(weights_only=False)` when the safe load fails; a
graph node's target is resolved by name from `torch.*` (so `torch.load` or `torch.hub.load` can be a node);
symbolic shape expressions go through `sympy.sympify`, which evaluates them; and an AOTInductor package carries a
shared library that is loaded and run. `check_pt2` reads the archive as JSON and bytes and refuses each of these,
naming the entry; only `--trust-checkpoint` skips it (an AOTInductor package is native code: trust it as you would
a binary).
"""

from __future__ import annotations

import io
import json
import re
import zipfile
from pathlib import Path

from plait.errors import CheckpointError
from plait.files import json_objects

MAX_ENTRIES = 100_000
MAX_JSON_BYTES = 256 << 20
MAX_SAMPLE_BYTES = 64 << 20
# the files torch.export.save writes, under the archive's root folder, for model name `m`
_PLAIN = re.compile(r"(archive_format|archive_version|byteorder|\.data/version|\.data/serialization_id"
                    r"|models/[\w.-]+\.json|data/weights/[\w.-]+_weights_config\.json|data/weights/weight_\d+"
                    r"|data/constants/[\w.-]+_constants_config\.json|data/constants/tensor_\d+"
                    r"|data/sample_inputs/[\w.-]+\.pt|extra/[\w.-]+)")
# graph targets that compute on tensors and symbols only
_TARGETS = re.compile(r"(torch\.ops\.(aten|prims)\.\w+\.\w+|_operator\.\w+|math\.\w+|torch\.sym_\w+)")
# srepr'd sympy expressions: these names, numbers, quoted symbol names, and punctuation; nothing else
_SYMPY = {"Symbol", "Integer", "Float", "Rational", "Add", "Mul", "Pow", "Mod", "Max", "Min", "Abs", "Eq", "Ne",
          "Lt", "Le", "Gt", "Ge", "StrictLessThan", "StrictGreaterThan", "LessThan", "GreaterThan", "Equality",
          "Unequality", "And", "Or", "Not", "true", "false", "True", "False", "positive", "negative", "integer",
          "nonnegative", "nonpositive", "real", "finite", "infinite", "precision", "oo", "zoo", "nan", "Infinity",
          "NegativeInfinity", "BooleanTrue", "BooleanFalse", "FloorDiv", "CleanDiv", "CeilDiv", "ModularIndexing",
          "PythonMod", "IntTrueDiv", "FloatTrueDiv", "TruncToInt", "FloorToInt", "CeilToInt", "RoundToInt",
          "ToFloat", "Identity", "Where", "OpaqueUnaryFn_sqrt", "BitwiseFn_bitwise_and", "BitwiseFn_bitwise_or"}
_SYMBOL = re.compile(r"[a-z]{1,3}\d+")  # shape symbols: s0, s77, u3
_TOKEN = re.compile(r"\s+|'[A-Za-z_]\w{0,63}'|\d+(\.\d+)?([eE][-+]?\d+)?|[A-Za-z_]\w*|[(),=+\-*/<>!]")


def _refuse(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: {what}; plait does not load it, because torch would run code from the file. "
                           "Export it again with `plait export RUN_DIR -o model.pt2`, or pass --trust-checkpoint "
                           "if you trust the file as you would a program")


def _expr_ok(text: str) -> bool:
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            return False
        tok = m.group(0)
        if (tok[0].isalpha() or tok[0] == "_") and tok not in _SYMPY and not _SYMBOL.fullmatch(tok):
            return False
        pos = m.end()
    return True


def _walk(node, path: Path, where: str) -> None:
    """Every graph node's target, every symbolic expression and every guard in a serialized program."""
    for item in json_objects(node):
        target = item.get("target")
        if isinstance(target, str) and "inputs" in item and not _TARGETS.fullmatch(target):
            raise _refuse(path, f"{where} calls {target[:80]!r}, which is not a tensor operator")
        expr = item.get("expr_str")
        if isinstance(expr, str) and not _expr_ok(expr):
            raise _refuse(path, f"{where} holds a shape expression that is not plain arithmetic ({expr[:80]!r})")


def _program(z: zipfile.ZipFile, name: str, path: Path) -> None:
    try:
        program = json.loads(z.read(name))
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: {name} is not JSON ({type(e).__name__}); export it again") from None
    if not isinstance(program, dict):
        raise CheckpointError(f"{path}: {name} is not a serialized program; export it again")
    if program.get("guards_code"):
        raise _refuse(path, f"{name} carries guard code")
    for key in program.get("range_constraints") or {}:
        if not _expr_ok(str(key)):
            raise _refuse(path, f"{name} has a range constraint that is not a plain symbol ({str(key)[:80]!r})")
    try:
        _walk(program.get("graph_module"), path, name)
    except RecursionError:
        raise CheckpointError(f"{path}: {name} nests too deeply; export it again") from None
    graph = (program.get("graph_module") or {}).get("graph") or {}
    if isinstance(graph, dict) and graph.get("custom_obj_values"):
        raise _refuse(path, f"{name} uses custom objects")


def _payloads(z: zipfile.ZipFile, name: str, path: Path) -> None:
    try:
        config = json.loads(z.read(name)).get("config")
    except (ValueError, AttributeError, RecursionError):
        raise CheckpointError(f"{path}: {name} is not a payload config; export it again") from None
    for fqn, meta in (config or {}).items() if isinstance(config, dict) else [("?", None)]:
        if not isinstance(meta, dict):
            raise CheckpointError(f"{path}: {name} entry {str(fqn)[:60]!r} is not a payload; export it again")
        if meta.get("use_pickle") or not re.fullmatch(r"(weight|tensor)_\d+", str(meta.get("path_name"))):
            raise _refuse(path, f"{name} stores {str(fqn)[:60]!r} as a pickle or object "
                                f"({str(meta.get('path_name'))[:40]!r})")


def _sample_inputs(z: zipfile.ZipFile, name: str, path: Path) -> None:
    """torch retries a sample-input file that the safe loader refuses with `weights_only=False`: test it first."""
    import torch

    if z.getinfo(name).file_size > MAX_SAMPLE_BYTES:
        raise CheckpointError(f"{path}: {name} is larger than {MAX_SAMPLE_BYTES >> 20} MiB; export it again")
    try:
        torch.load(io.BytesIO(z.read(name)), weights_only=True)
    except Exception as e:
        raise _refuse(path, f"{name} is not plain tensors ({type(e).__name__})") from None


def check_pt2(path: Path) -> None:
    """Refuse, naming the entry, a .pt2 from which `torch.export.load` would run code (AOTInductor packages too)."""
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
            if len(infos) > MAX_ENTRIES:
                raise CheckpointError(f"{path} has {len(infos)} entries; a .pt2 plait writes has a few dozen")
            roots = {i.filename.split("/", 1)[0] for i in infos}
            if len(roots) != 1 or any("/" not in i.filename for i in infos):
                raise CheckpointError(f"{path} is not a .pt2 archive (its entries are not under one folder)")
            for info in infos:
                rel = info.filename.split("/", 1)[1]
                if rel.startswith("data/aotinductor/"):
                    raise _refuse(path, "it is an AOTInductor package (a compiled shared library)")
                if not _PLAIN.fullmatch(rel) and not info.is_dir():
                    raise _refuse(path, f"it holds {rel[:80]!r}, which torch.export.save does not write")
                if rel.endswith(".json") and not rel.startswith("extra/") and info.file_size > MAX_JSON_BYTES:
                    raise CheckpointError(f"{path}: {rel} is larger than {MAX_JSON_BYTES >> 20} MiB")
            for info in infos:
                rel = info.filename.split("/", 1)[1]
                if rel.startswith("models/"):
                    _program(z, info.filename, path)
                elif rel.endswith(("_weights_config.json", "_constants_config.json")):
                    _payloads(z, info.filename, path)
                elif rel.startswith("data/sample_inputs/"):
                    _sample_inputs(z, info.filename, path)
    except (OSError, zipfile.BadZipFile, EOFError, ValueError) as e:
        raise CheckpointError(f"{path} is not a .pt2 archive ({type(e).__name__}: {str(e)[:200]})") from None


__all__ = ["check_pt2"]
