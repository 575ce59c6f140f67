"""`plait export RUN_DIR [-o FILE] ...`: the flags checked, then plait.api.export (the one front door of every export)."""

from __future__ import annotations

from plait.api import export
from plait.edge import check_request, export_edge
from plait.errors import ConfigError
from plait.rundir import is_federated_run


def cmd_export(a) -> int:
    if a.format == "hf":
        out = export(a.run_dir, a.output, format="hf", best=a.best, trust_checkpoint=a.trust_checkpoint,
                     adapters_only=a.adapters_only, batch=a.batch, quantize=a.edge_quantize, aoti=a.aoti)
        print(f"wrote {out}")
        return 0
    if a.output is not None and a.output.suffix in (".onnx", ".pt2", ".pte"):
        return cmd_export_edge(a)
    if a.output is not None and a.output.is_dir():
        a.output = a.output / "model.safetensors"  # -o exports/: into that folder
    if a.output is not None and a.output.suffix != ".safetensors":
        raise ConfigError(f"-o {a.output}: plait writes .safetensors (weights) or an edge export (.onnx, .pt2, .pte); "
                          "name the file with one of these suffixes")
    if a.batch is not None or a.edge_quantize or a.aoti:
        raise ConfigError("--batch, --quantize and --aoti apply to edge exports: pass -o model.onnx or -o model.pt2")
    out = export(a.run_dir, a.output, best=a.best, trust_checkpoint=a.trust_checkpoint, adapters_only=a.adapters_only)
    # a federated run's global model is exported as it finishes
    print(f"{out} (a federated run's global model, already exported)" if a.output is None and
          is_federated_run(a.run_dir) else f"wrote {out}")
    return 0


def cmd_export_edge(a) -> int:
    check_request(a.output, a.batch, a.edge_quantize, a.aoti)  # flags first, before the model loads
    report = export_edge(a.run_dir, a.output, batch=a.batch, quantize=a.edge_quantize, aoti=a.aoti,
                         trust_checkpoint=a.trust_checkpoint)
    print("\n".join(report.lines()))
    return 0
