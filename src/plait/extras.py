"""plait's optional extras: which one a missing module belongs to, and an install command that keeps the torch you
have (pip would otherwise resolve the extra's dependencies against the newest torch on PyPI, a CUDA build).

    missing_extra(err)      # ModuleNotFoundError of an extra's module -> the one line to print, else None
    install_command("edge") # pip install 'plait[edge]' 'torch==2.13.0' (the installed torch, pinned)
    torchvision_warning()   # a torchvision built for another torch (it cannot load, and breaks transformers)
"""

from __future__ import annotations

import importlib.metadata as metadata
import re

# the top-level module -> (its extra, what it does for plait)
MODULES = {
    "onnx": ("edge", "ONNX export"), "onnxscript": ("edge", "ONNX export"), "onnxruntime": ("edge", "ONNX serving"),
    "litdata": ("data", "packed datasets (LitData)"), "zstd": ("data", "packed datasets"),
    "PIL": ("data", "image folders (Pillow)"), "cleanlab": ("audit", "the data audit (cleanlab)"),
    "torchao": ("lowbit", "8-bit optimizers and int8 quantization (torchao)"),
    "bitsandbytes": ("qlora", "QLoRA's nf4 base (bitsandbytes)"), "tensorboard": ("tensorboard", "TensorBoard logs"),
    "mlflow": ("mlflow", "MLflow tracking"), "wandb": ("wandb", "W&B tracking"),
    "transformers": ("hf", "Hugging Face models"), "tokenizers": ("hf", "Hugging Face tokenizers"),
    "pyarrow": ("table", "Parquet tables"), "optuna": ("tune", "plait tune (Optuna)"), "ray": ("ray", "Ray Train"),
    "llguidance": ("structured", "structured output (llguidance)"),
}


def torch_pin() -> str:
    """'torch==X.Y.Z' of the installed torch: a local build (+cpu) satisfies it, so pip keeps it."""
    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "torch"
    return f"torch=={version.split('+', 1)[0]}"


def install_command(extra: str) -> str:
    return f"pip install 'plait[{extra}]' '{torch_pin()}'"


def missing_extra(err: ModuleNotFoundError) -> str | None:
    """The one line for a module of an extra that is not installed (None: not an extra's module)."""
    root = (err.name or "").split(".", 1)[0]
    if root not in MODULES:
        return None
    extra, what = MODULES[root]
    return (f"{what} needs the {root} package, which is not installed: {install_command(extra)} (the torch pin keeps "
            "your torch; from a checkout, `make extras EXTRAS=" + extra + "`)")


def torchvision_warning() -> str | None:
    """A torchvision whose wheel pins another torch than the installed one cannot load its operators, and
    `import transformers` then fails; plait does not use torchvision. Read from the package metadata (no import)."""
    try:
        wants = [r for r in metadata.requires("torchvision") or [] if re.match(r"torch\s*==", r)]
        have = metadata.version("torch").split("+", 1)[0]
    except metadata.PackageNotFoundError:
        return None
    pinned = [r.split("==", 1)[1].split(";", 1)[0].strip() for r in wants]
    if not pinned or all(p.split("+", 1)[0] == have for p in pinned):
        return None
    return (f"warning: torchvision {metadata.version('torchvision')} is built for torch {pinned[0]}, not the installed "
            f"torch {have}: it cannot load, and `import transformers` fails with it; plait does not use it: "
            "pip uninstall -y torchvision")


__all__ = ["MODULES", "install_command", "missing_extra", "torch_pin", "torchvision_warning"]
