"""Export a run to the edge: `plait export RUN_DIR -o model.onnx | model.pt2 | model.pte [--batch dynamic|N]
[--quantize int8] [--aoti]`, and load such a file for serving (`plait serve model.onnx`).

    .onnx   torch.onnx.export(dynamo=True), checked by onnx.checker, run by onnxruntime;
            --quantize int8: onnxruntime's dynamic quantization (sizes before and after are reported)
    .pt2    torch.export's ExportedProgram; --aoti also compiles it with AOTInductor into the archive
    .pte    ExecuTorch: refused with the reason when ExecuTorch is not installed (it is not a plait extra)

Each export runs the parity gate (plait.edge.parity) on the written file itself, loaded the way
`plait serve` loads it; a file that misses its bound is removed and the command exits 2.
The safetensors export (plait.export) is untouched; this package only adds formats.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from plait.edge.formats import (
    EdgeModule,
    dynamic_shapes,
    file_size,
    load_onnx,
    load_pt2,
    quantize_onnx,
    write_onnx,
    write_pt2,
)
from plait.edge.parity import Parity, ParityError, compare, held_out
from plait.errors import CheckpointError, ConfigError
from plait.export import _from_meta, load_run_checkpoint
from plait.files import publish
from plait.finetune import merge_lora

EDGE_SUFFIXES = (".onnx", ".pt2", ".pte")
QUANTIZE_CHOICES = ("int8",)


@dataclass
class EdgeReport:
    path: Path
    format: str
    batch: str
    parity: Parity
    size_bytes: int
    fp32_size_bytes: int | None = None  # --quantize int8: the fp32 file's size
    export_s: float = 0.0
    backend: str = ""

    def lines(self) -> list[str]:
        size = f"{self.size_bytes / 1024:.1f} KiB"
        if self.fp32_size_bytes:
            size = (f"{self.fp32_size_bytes / 1024:.1f} KiB fp32 -> {size} int8 "
                    f"({self.size_bytes / self.fp32_size_bytes:.2f}x)")
        return [f"wrote {self.path} ({self.format}, batch {self.batch}, {size}) in {self.export_s:.1f} s",
                f"  {self.parity.line()} [{self.backend}] -> {'ok' if self.parity.ok else 'FAILED'}"]


def parse_batch(text: str | int | None) -> int | None:
    """--batch: 'dynamic' (the default: a batch axis of any size, as users of an exported model expect) -> None, else
    a positive integer, the fixed batch size."""
    if text is None or str(text) == "dynamic":
        return None
    if str(text).isdigit() and 0 < int(text) <= 1 << 16:
        return int(text)
    raise ConfigError(f"--batch {text!r} must be 'dynamic' or a positive integer (the fixed batch size)")


def check_request(out: Path, batch: str | int | None, quantize: str | None, aoti: bool) -> int | None:
    """Flag combinations, checked before any model is loaded."""
    suffix = out.suffix
    if suffix not in EDGE_SUFFIXES:
        raise ConfigError(f"-o {out}: an edge export is one of {', '.join(EDGE_SUFFIXES)} (or .safetensors)")
    rows = parse_batch(batch)
    if quantize is not None and quantize not in QUANTIZE_CHOICES:
        raise ConfigError(f"--quantize {quantize!r} is not one of: {', '.join(QUANTIZE_CHOICES)}")
    if quantize and suffix != ".onnx":
        raise ConfigError(f"--quantize int8 is for .onnx exports (onnxruntime's quantization); -o {out} is {suffix}")
    if aoti and suffix != ".pt2":
        raise ConfigError(f"--aoti compiles a .pt2 with AOTInductor; -o {out} is {suffix}")
    if suffix == ".pte":
        try:
            import executorch  # noqa: F401
        except ImportError:
            raise ConfigError("-o model.pte needs ExecuTorch, which is not installed (it is large and built against one "
                              "torch release, so it is not in plait[edge]); export .onnx or .pt2 instead") from None
        raise ConfigError("-o model.pte: this plait does not write ExecuTorch programs yet; export .onnx or .pt2")
    return rows


def load_run_model(run_dir: Path, checkpoint: str | Path | None = None, trust_checkpoint: bool = False):
    """The run's config, data spec and eager model with the latest (or the given) checkpoint's weights (LoRA adapters
    merged), in eval mode."""
    cfg, spec, model, ckpt = load_run_checkpoint(run_dir, checkpoint, trust_checkpoint)
    model = merge_lora(model)  # a LoRA run's adapters folded into the weights they adapt (as `plait export` does)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return cfg, spec, model, ckpt


def export_edge(run_dir: str | Path, out: str | Path, batch: str | int | None = None, quantize: str | None = None,
                aoti: bool = False, checkpoint: str | Path | None = None, trust_checkpoint: bool = False,
                samples: int = 256, model=None) -> EdgeReport:
    """Export the run to `out` (.onnx or .pt2), run the parity gate on the written file, and report.

    `model`: an eager module to export instead of the checkpoint's (e.g. one with adapters merged).
    """
    run_dir, out = Path(run_dir), Path(out)
    rows = check_request(out, batch, quantize, aoti)
    started = time.perf_counter()
    cfg, spec, eager, ckpt = load_run_model(run_dir, checkpoint, trust_checkpoint)
    if model is not None:
        eager = model.eval()
    if spec.task == "contrastive":
        raise ConfigError(f"{run_dir} is a contrastive run (an encoder, no served outputs); edge export takes "
                          "classification, binary and lm runs")
    is_lm = spec.task == "lm"
    context = int(getattr(eager, "context", spec.input_shape[0] if spec.input_shape else 1))

    def example(n: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(0)
        if is_lm:
            return torch.randint(0, spec.vocab_size, (n, context), generator=g)
        return torch.randn(n, *spec.input_shape, generator=g)

    data = held_out(run_dir, spec, example, samples)
    traced = data.x[: (rows or 2)]  # a dynamic batch is traced with 2 rows: 1 would be specialised
    if len(traced) < (rows or 2):
        traced = torch.cat([traced, example((rows or 2) - len(traced)).to(traced.dtype)])
    meta = {"plait.model": json.dumps(dataclasses.asdict(cfg.model)), "plait.spec": json.dumps(dataclasses.asdict(spec)),
            "plait.checkpoint": ckpt.name, "plait.batch": "dynamic" if rows is None else str(rows),
            "plait.format": out.suffix[1:] + ("-int8" if quantize else "")}
    tok = run_dir / "tokenizer.json"
    if tok.is_file():
        meta["plait.tokenizer"] = tok.read_text()
    shapes = dynamic_shapes(is_lm, rows is None, context)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp" + out.suffix)
    fp32_size = None
    try:
        if out.suffix == ".onnx":
            name = "input_ids" if is_lm else "input"
            if quantize:
                fp32 = out.with_name(out.name + ".fp32.tmp.onnx")
                try:
                    write_onnx(eager, traced, fp32, meta, shapes, name)
                    fp32_size = file_size(fp32)
                    quantize_onnx(fp32, tmp)
                finally:
                    fp32.unlink(missing_ok=True)
            else:
                write_onnx(eager, traced, tmp, meta, shapes, name)
        else:
            write_pt2(eager, traced, tmp, meta, shapes, aoti)
        exported, _ = load_edge(tmp, trust=True)  # the file this call just wrote
        parity = compare(eager, exported, data, spec, quantized=bool(quantize))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    report = EdgeReport(out, out.suffix[1:] + ("-int8" if quantize else ""), "dynamic" if rows is None else str(rows),
                        parity, file_size(tmp), fp32_size, time.perf_counter() - started, exported.backend)
    if not parity.ok:
        tmp.unlink(missing_ok=True)
        raise ParityError(f"{out}: the exported model does not match the eager one: {parity.line()}; nothing was "
                          "written (see docs/serving.md, 'Export to the edge')")
    publish(tmp, out)
    return report


def load_edge(path: str | Path, threads: int | None = None, trust: bool = False) -> tuple[EdgeModule, dict]:
    """An exported .onnx or .pt2 as a module (tensor in, logits out) and its plait metadata. A .pt2 from which torch
    would run code (pickled payloads, non-tensor graph targets, an AOTInductor library) is refused unless `trust`."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    if path.suffix == ".onnx":
        module, meta = load_onnx(path, threads)
    elif path.suffix == ".pt2":
        module, meta = load_pt2(path, trust)
    else:
        raise ConfigError(f"{path}: serving takes .onnx or .pt2 edge files (a .pte runs on ExecuTorch's runtime)")
    if "plait.model" not in meta:
        raise CheckpointError(f"{path} has no plait metadata; export it with `plait export RUN_DIR -o {path.name}`")
    _from_meta(path, meta)  # the model config and spec, checked as data
    return module, meta


__all__ = ["EDGE_SUFFIXES", "EdgeReport", "ParityError", "check_request", "export_edge", "load_edge", "parse_batch"]
