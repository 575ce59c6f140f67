"""What is served: a model loaded from a run directory, an exported model.safetensors or a Hugging Face GPT-2
directory (plait.models.hf), and its signature.

`ModelRef` is the picklable recipe (path + options) that replica and pipeline-stage processes
use to load the same weights themselves; `ServedModel` is the loaded model with the tensor
names, datatypes and shapes that the Open Inference Protocol metadata advertises.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from plait.data.chat import ChatTemplate, template_of, tokenizer_config
from plait.data.hf_tokenizer import HFTokenizer
from plait.data.spec import DataSpec
from plait.data.tokenizer import CharTokenizer
from plait.edge import EDGE_SUFFIXES, load_edge
from plait.errors import DataError
from plait.export import load_exported, rebuild_model
from plait.models.ensemble import Ensemble
from plait.models.gpt import GPT
from plait.models.hf import is_hf_dir, load_hf_model
from plait.models.llama import Llama
from plait.serve.errors import ServeError
from plait.serve.model.quantize import quantize_int8
from plait.serve.model.signature import TensorSpec
from plait.train.carried import carried_dir
from plait.train.checkpoint import latest_checkpoint, load_model_weights

DECODERS = (GPT, Llama)  # the models whose cached forward (idx, cache, pad) generation drives
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class ModelRef:
    """Where the weights come from and how to prepare them; every worker process loads from it."""

    path: str
    quantize: str | None = None  # None or "int8"
    trust_factory: bool = False  # an exported file may name a model.factory (code): build it only when trusted
    trust_checkpoint: bool = False  # accept a run's checkpoint that has no manifest (plait 0.1)


@dataclass
class ServedModel:
    module: nn.Module
    registry_name: str  # `mlp`, `gpt`, ... or the factory function's name
    spec: DataSpec
    tokenizer: CharTokenizer | HFTokenizer | None
    checkpoint: str  # which checkpoint the weights came from (for the metadata)
    backend: str = "pytorch"  # or "onnxruntime", "torch.export", "aotinductor" (an exported file, plait.edge)
    chat: ChatTemplate | None = None  # a Hugging Face directory's chat template (/v1/chat/completions)
    eos_ids: frozenset[int] = frozenset()  # tokens that end a generation (a Hugging Face config's eos_token_id)

    @property
    def is_lm(self) -> bool:
        return self.spec.task == "lm"

    @property
    def can_generate(self) -> bool:
        """Text generation needs a tokenizer and plait's GPT or llama (see plait.serve.executor.generate)."""
        return self.is_lm and self.tokenizer is not None and isinstance(self.module, DECODERS)

    @property
    def context(self) -> int:
        return int(getattr(self.module, "context", self.spec.input_shape[0] if self.spec.input_shape else 0))

    @property
    def inputs(self) -> list[TensorSpec]:
        if self.is_lm:
            return [TensorSpec("input_ids", "INT64", (-1, -1))]
        return [TensorSpec("input", "FP32", (-1, *self.spec.input_shape))]

    @property
    def outputs(self) -> list[TensorSpec]:
        if self.is_lm:
            return [TensorSpec("logits", "FP32", (-1, -1, self.vocab_size))]
        specs = [TensorSpec("logits", "FP32", (-1, self.spec.num_classes)), TensorSpec("label", "INT64", (-1,))]
        return specs + [TensorSpec("spread", "FP32", (-1,))] if self.is_ensemble else specs

    @property
    def is_ensemble(self) -> bool:
        """model.ensemble > 1: logits are the members' mean probabilities' logs, and `spread` their disagreement."""
        return isinstance(self.module, Ensemble) and not self.is_lm

    @property
    def vocab_size(self) -> int:
        head = getattr(self.module, "head", None)
        return int(head.out_features) if isinstance(head, nn.Linear) else int(self.spec.vocab_size)

    def example_input(self, rows: int, seed: int = 0) -> torch.Tensor:
        """A deterministic input batch of the model's input shape (start-up checks and benchmarks)."""
        g = torch.Generator().manual_seed(seed)
        if self.is_lm:
            t = max(1, min(self.context, 16))
            return torch.randint(0, self.vocab_size, (rows, t), generator=g)
        return torch.randn(rows, *self.spec.input_shape, generator=g)


def freeze_loaded() -> int:
    """Move everything this process holds so far (modules, the model, its tokenizer: about 300 k objects behind
    `plait serve`) out of the garbage collector's reach, once loading is done; returns how many. A full collection of
    them took 230-260 ms holding the interpreter lock, a stall of the engine and of every stream at once: the served
    benchmark's mixed work at three rates in one session had one TTFT p99 of 518-604 ms in each session, none above
    251 ms once frozen. vLLM freezes its heap after start-up for the same reason. What is allocated later is
    collected as usual."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _registry_name(model_cfg: dict) -> str:
    if model_cfg.get("factory"):
        return model_cfg["factory"].rpartition(":")[2]
    return model_cfg["name"]


def _tokenizer(text: str, where: str) -> CharTokenizer | HFTokenizer:
    """A tokenizer from its JSON, checked as data (one character per entry), or a Hugging Face tokenizer.json."""
    try:
        data = json.loads(text)
        if isinstance(data, dict) and "chars" not in data and "model" in data:  # a run trained with data.tokenizer
            return HFTokenizer.from_json(text)
        chars = data["chars"]
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise ServeError(f"{where}: the tokenizer is malformed ({type(e).__name__}: {e})") from None
    if not isinstance(chars, list) or not all(isinstance(c, str) and len(c) == 1 for c in chars):
        raise ServeError(f"{where}: the tokenizer must be a list of single characters")
    return CharTokenizer(chars)


def _check_finite(module: nn.Module, where: str) -> None:
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        for part in _plain_parts(t):
            if part.is_floating_point() and not bool(torch.isfinite(part).all()):
                raise ServeError(f"{where}: {name} holds NaN or Inf; refusing to serve a model with broken weights")


def _plain_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """A tensor subclass (torchao's int8 weights of a `plait compress` file) as the plain tensors it holds."""
    if type(t) in (torch.Tensor, nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return [t]
    return [p for n in t.__tensor_flatten__()[0] for p in _plain_parts(getattr(t, n))]


def load_model(ref: ModelRef) -> ServedModel:
    """Load the weights `ref` names (latest checkpoint of a run dir, or an exported file), in eval mode."""
    path = Path(ref.path)
    if path.is_dir() and (path / "partition.json").is_file() and not (path / "checkpoints").exists() \
            and (path / "model.safetensors").is_file():
        path = path / "model.safetensors"  # a federated run (plait fed): no checkpoints, its final global model
    if is_hf_dir(path):  # a Hugging Face directory (config.json, model.safetensors, tokenizer.json)
        hf_cfg, spec, module, tokenizer = load_hf_model(path)
        served = ServedModel(module, hf_cfg.name, spec, tokenizer, "", chat=_chat_template(path),
                             eos_ids=_eos_ids(path))
    elif path.is_dir():
        if not (path / "config.toml").is_file():
            raise ServeError(f"{path} is not a plait run directory (no config.toml); pass a run's --out or a model.safetensors")
        ckpt = latest_checkpoint(path)
        if ckpt is None:
            raise ServeError(f"{path} has no checkpoint yet (checkpoints/latest is missing); train it first")
        cfg, spec, module = rebuild_model(path)
        load_model_weights(module, ckpt, trust=ref.trust_checkpoint)
        tok_file = path / "tokenizer.json"
        tokenizer = _tokenizer(tok_file.read_text(), str(tok_file)) if tok_file.is_file() else None
        hf = carried_dir(path)  # a run from a Hugging Face checkpoint keeps its chat template and stop tokens there
        served = ServedModel(module, _registry_name(dataclasses.asdict(cfg.model)), spec, tokenizer, ckpt.name,
                             chat=_chat_template(hf) if hf else None, eos_ids=_eos_ids(hf) if hf else frozenset())
    elif path.is_file() and path.suffix in EDGE_SUFFIXES:
        if ref.quantize:
            raise ServeError(f"--quantize applies to PyTorch weights; {path} is an exported file: export it with "
                             f"`plait export RUN_DIR -o {path.name} --quantize int8` instead")
        module, meta = load_edge(path, threads=torch.get_num_threads(), trust=ref.trust_checkpoint)
        spec = DataSpec(**json.loads(meta["plait.spec"]))
        tokenizer = _tokenizer(meta["plait.tokenizer"], str(path)) if "plait.tokenizer" in meta else None
        checkpoint = meta.get("plait.checkpoint", "")
        served = ServedModel(module, _registry_name(json.loads(meta["plait.model"])), spec, tokenizer,
                             checkpoint if NAME_RE.match(checkpoint or "x") else "", backend=module.backend)
    elif path.is_file():
        module, meta = load_exported(path, trust_factory=ref.trust_factory)
        spec = DataSpec(**json.loads(meta["plait.spec"]))
        tokenizer = _tokenizer(meta["plait.tokenizer"], str(path)) if "plait.tokenizer" in meta else None
        checkpoint = meta.get("plait.checkpoint", "")
        served = ServedModel(module, _registry_name(json.loads(meta["plait.model"])), spec, tokenizer,
                             checkpoint if NAME_RE.match(checkpoint or "x") else "")
    else:
        raise ServeError(f"{path} does not exist; pass a run directory or an exported model.safetensors (or .onnx, .pt2)")
    _check_finite(served.module, str(path))
    served.module.eval()
    for p in served.module.parameters():
        p.requires_grad_(False)
    if ref.quantize:
        served.module = quantize_int8(served.module)
    return served


def _chat_template(path: Path) -> ChatTemplate | None:
    """The chat template of a Hugging Face directory's tokenizer_config.json (None without one)."""
    tokenizer = path / "tokenizer.json"
    try:
        return template_of(tokenizer_config(str(tokenizer)), str(tokenizer))
    except DataError as e:
        raise ServeError(str(e)) from None


def _eos_ids(path: Path) -> frozenset[int]:
    """config.json's (or generation_config.json's) eos_token_id, an id or a list of ids."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        f = path / name
        try:
            value = json.loads(f.read_text(encoding="utf-8")).get("eos_token_id") if f.is_file() else None
        except (ValueError, AttributeError):
            value = None
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                ids.add(v)
    return frozenset(ids)


def check_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise ServeError(f"--name {name!r} must be letters, digits, '_', '.' or '-' (it becomes part of URLs)")
    return name
