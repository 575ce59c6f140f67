"""Writing and reading the edge formats: ONNX (onnxruntime) and .pt2 (torch.export, optionally AOTInductor).

Every file carries the metadata `plait serve` needs to describe the model (`plait.model`,
`plait.spec`, `plait.tokenizer`, `plait.batch`): ONNX in its metadata_props, .pt2 as an extra file.
`load_edge` returns a torch-in, torch-out module around the runtime, so the serving code (runner,
batcher, replicas) runs an exported file exactly as it runs an eager model.

A file exported with `--batch dynamic` (the default) takes any number of rows at once; one with a fixed batch
(`--batch N`) is run in chunks of N rows, the last one padded with zeros.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from plait.edge.archive import check_pt2
from plait.errors import CheckpointError, ConfigError
from plait.extras import install_command

MAX_DYNAMIC_BATCH = 1 << 16
META_FILE = "plait.json"  # the .pt2 archive's extra file holding the metadata


class EdgeModule(nn.Module):
    """An exported model's runtime as a module: a (B, ...) tensor in, the logits tensor out."""

    def __init__(self, run: Callable[[torch.Tensor], torch.Tensor], batch: int | None, backend: str):
        super().__init__()
        self._run, self.batch, self.backend = run, batch, backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device
        x = x.cpu()
        if self.batch is None:
            return self._run(x).to(device)
        n, parts = x.shape[0], []
        for i in range(0, n, self.batch):
            chunk = x[i:i + self.batch]
            m = chunk.shape[0]
            if m < self.batch:
                chunk = torch.cat([chunk, chunk.new_zeros(self.batch - m, *chunk.shape[1:])])
            parts.append(self._run(chunk)[:m])
        return (torch.cat(parts) if parts else self._run(x)).to(device)


def _quiet():
    """The exporters print progress and warnings of their own; plait prints one report instead."""
    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    return stack


def dynamic_shapes(is_lm: bool, dynamic: bool, context: int):
    """torch.export's dynamic_shapes for the one input: the batch when `dynamic`, and an LM's sequence always."""
    dims = {0: torch.export.Dim("batch", min=1, max=MAX_DYNAMIC_BATCH)} if dynamic else {}
    if is_lm:  # prompts come in any length up to the context, whatever the batch
        dims[1] = torch.export.Dim("tokens", min=1, max=max(2, context))
    return (dims,) if dims else None


# ------------------------------------------------------------------ ONNX

def write_onnx(module: nn.Module, example: torch.Tensor, out: Path, meta: dict, shapes, input_name: str) -> None:
    """torch.onnx.export(dynamo=True), the metadata added, checked by onnx.checker."""
    import onnx

    with _quiet():
        program = torch.onnx.export(module, (example,), dynamo=True, input_names=[input_name], output_names=["logits"],
                                    dynamic_shapes=shapes, verbose=False)
    proto = program.model_proto
    for key, value in meta.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(proto, str(out))
    onnx.checker.check_model(str(out), full_check=True)


def quantize_onnx(src: Path, out: Path) -> None:
    """onnxruntime's dynamic int8 quantization (weights int8 per tensor, activations quantized on the fly)."""
    import logging

    from onnxruntime.quantization import QuantType, quantize_dynamic

    logging.disable(logging.WARNING)  # it advises shape-inference pre-processing on the root logger
    try:
        with _quiet():
            quantize_dynamic(str(src), str(out), weight_type=QuantType.QInt8)
    finally:
        logging.disable(logging.NOTSET)
    import onnx

    onnx.checker.check_model(str(out))


def _onnx_session(path: Path, threads: int):
    try:
        import onnxruntime as ort
    except ImportError:
        raise ConfigError(f"{path}: serving an .onnx file needs onnxruntime: {install_command('edge')}") from None
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    try:
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise CheckpointError(f"{path} is not a model onnxruntime can load ({type(e).__name__}: "
                              f"{str(e).strip().splitlines()[0][:300] if str(e).strip() else ''})") from None


def load_onnx(path: Path, threads: int | None = None) -> tuple[EdgeModule, dict]:
    session = _onnx_session(path, threads or torch.get_num_threads())
    try:  # onnxruntime decodes the metadata's strings only here: a damaged file fails at this line
        meta = dict(session.get_modelmeta().custom_metadata_map)
    except (UnicodeDecodeError, RuntimeError) as e:
        raise CheckpointError(f"{path}: its metadata cannot be read ({type(e).__name__}: {str(e)[:200]}); the file is "
                              "damaged: export it again") from None
    inp = session.get_inputs()[0]
    name = inp.name
    want = np.int64 if "int64" in inp.type else np.float32

    def run(x: torch.Tensor) -> torch.Tensor:
        (logits,) = session.run(["logits"], {name: np.ascontiguousarray(x.numpy(), dtype=want)})
        return torch.from_numpy(logits)

    return EdgeModule(run, _batch_of(meta, path), "onnxruntime"), meta


# ------------------------------------------------------------------ .pt2

def write_pt2(module: nn.Module, example: torch.Tensor, out: Path, meta: dict, shapes, aoti: bool) -> None:
    """torch.export's ExportedProgram, saved with the metadata; with `aoti`, also compiled by AOTInductor
    into the same archive (a C++ compiler is needed)."""
    with _quiet():
        program = torch.export.export(module, (example,), dynamic_shapes=shapes)
        extra = {META_FILE: json.dumps(meta)}
        if not aoti:
            torch.export.save(program, str(out), extra_files=extra)
            return
        from torch.export.pt2_archive._package import package_pt2

        files = torch._inductor.aot_compile(program.module(), (example,), options={"aot_inductor.package": True})
        package_pt2(str(out), exported_programs={"model": program}, aoti_files={"model": files}, extra_files=extra)


def load_pt2(path: Path, trust: bool = False) -> tuple[EdgeModule, dict]:
    """An AOTInductor archive runs its compiled code; a plain one runs the ExportedProgram's graph in eager.
    Unless `trust`, the archive is inspected first and refused if torch would run code from it (plait.edge.archive)."""
    import zipfile


    if not trust:
        check_pt2(path)
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except (OSError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"{path} is not a .pt2 archive ({e})") from None
    compiled = any("/data/aotinductor/" in n for n in names)
    try:
        with _quiet():
            if compiled:
                from torch.export.pt2_archive._package import load_pt2 as _load

                contents = _load(str(path))
                meta = json.loads(contents.extra_files[META_FILE])
                runner = contents.aoti_runners["model"]

                def run(x: torch.Tensor) -> torch.Tensor:
                    out = runner(x)
                    return out[0] if isinstance(out, (list, tuple)) else out

                backend = "aotinductor"
            else:
                extra = {META_FILE: ""}
                program = torch.export.load(str(path), extra_files=extra)
                meta = json.loads(extra[META_FILE])
                gm = program.module()

                def run(x: torch.Tensor) -> torch.Tensor:
                    with torch.inference_mode():
                        return gm(x)

                backend = "torch.export"
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{path} has no plait metadata ({type(e).__name__}); export it with "
                              "`plait export RUN_DIR -o model.pt2`") from None
    except Exception as e:
        raise CheckpointError(f"{path} is not a .pt2 file torch can load ({type(e).__name__}: "
                              f"{str(e).strip()[:300]})") from None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(f"{path}: its {META_FILE} must be a JSON object of strings")
    return EdgeModule(run, _batch_of(meta, path), backend), meta


def _batch_of(meta: dict, path: Path) -> int | None:
    batch = meta.get("plait.batch", "dynamic")
    if batch == "dynamic":
        return None
    if not batch.isdigit() or not 0 < int(batch) <= MAX_DYNAMIC_BATCH:
        raise CheckpointError(f"{path}: metadata plait.batch = {batch[:20]!r} must be 'dynamic' or a positive integer")
    return int(batch)


def file_size(path: Path) -> int:
    return os.path.getsize(path)
