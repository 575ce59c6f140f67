"""Export a run to one consolidated model.safetensors with the plain model's parameter names.

The metadata carries what it takes to rebuild the model (`plait.model`, `plait.spec`,
and `plait.tokenizer` for text models), so `load_exported` needs nothing else.

An exported file may come from someone else (docs/security.md): `load_exported` builds a
registered model from its metadata, but a `model.factory` named there is code, imported and
called only when the caller passes `trust_factory=True` (`plait serve --trust-factory`).
Before any weights are loaded the model is built on the meta device and its tensor names,
shapes and dtypes are compared with the file's, so a file cannot make plait allocate more
than it holds; weights that are not finite are refused. Every problem is a CheckpointError.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import torch
import torch.nn as nn

from plait import CallableModule
from plait.config import ModelConfig
from plait.data.spec import DataSpec
from plait.errors import CheckpointError, ConfigError, PlaitError
from plait.files import publish
from plait.finetune import adapter_layers, adapter_state_dict, adapters_state_dict, apply_adapters, lora_layers, merge_lora
from plait.finetune.lowrank import with_low_rank_structure
from plait.models import build_model
from plait.models.hf import is_hf_dir
from plait.models.hf_llama import to_hf
from plait.train.carried import FILES as CARRIED
from plait.train.carried import carried_dir
from plait.train.checkpoint import latest_checkpoint, load_model_weights
from plait.train.weights import build_run_model


def load_run_checkpoint(run_dir: Path, checkpoint: str | Path | None = None, trust_checkpoint: bool = False):
    """(config, data spec, model, checkpoint folder): the run's model with the latest (or the given) checkpoint loaded."""
    if not (run_dir / "config.toml").is_file():
        raise CheckpointError(f"{run_dir} is not a plait run directory (no config.toml); pass the --out of a run")
    ckpt = Path(checkpoint) if checkpoint else latest_checkpoint(run_dir)
    if ckpt is None:
        raise CheckpointError(f"{run_dir} has no checkpoint yet; train it first (checkpoints/latest is missing)")
    cfg, spec, model = rebuild_model(run_dir)
    load_model_weights(model, ckpt, trust=trust_checkpoint or None)
    return cfg, spec, model, ckpt


def rebuild_model(run_dir: Path):
    """The run's config and a freshly built (untrained) model: the plain model, with the run's LoRA adapters if it
    trained any (their checkpoint names load into it; `merge_lora` then gives the plain model back)."""
    return build_run_model(Path(run_dir))


def export(run_dir: str | Path, out: str | Path | None = None, checkpoint: str | Path | None = None,
           trust_checkpoint: bool = False, adapters_only: bool = False) -> Path:
    """Write the latest (or the given) checkpoint's weights as safetensors; returns the file written.

    `trust_checkpoint` accepts a checkpoint without a manifest (plait 0.1 wrote none). A LoRA run's adapters
    are merged into the weights they adapt (the plain model's names and shapes), or with `adapters_only`
    written alone (`<layer>.lora_A`, `<layer>.lora_B`, with the rank, alpha and targets in the metadata).
    """
    from safetensors.torch import save_file

    run_dir = Path(run_dir)
    cfg, spec, model, ckpt = load_run_checkpoint(run_dir, checkpoint, trust_checkpoint)
    bottleneck = adapter_layers(model)
    if adapters_only and not (lora_layers(model) or bottleneck):
        raise CheckpointError(f"--adapters-only: {run_dir} trained no adapters (finetune.lora_rank = 0, "
                              "finetune.adapters = {}); export the whole model without it")
    if adapters_only:
        state = adapters_state_dict(model) if bottleneck else adapter_state_dict(model)
    else:
        state = merge_lora(model).state_dict()  # bottleneck adapters are not linear: they stay, named as trained
    # Tied weights share storage; safetensors wants each name to own its tensor.
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
    meta = {
        "format": "pt",
        "plait.model": json.dumps(dataclasses.asdict(cfg.model)),
        "plait.spec": json.dumps(dataclasses.asdict(spec)),
        "plait.checkpoint": ckpt.name,
    }
    if bottleneck:
        meta["plait.adapters"] = json.dumps({"size": cfg.finetune.adapters.get("size", 16), "layers": list(bottleneck)})
    if adapters_only and not bottleneck:
        f = cfg.finetune
        meta["plait.lora"] = json.dumps({"rank": f.lora_rank, "alpha": f.lora_alpha, "targets": f.lora_targets})
    tok = run_dir / "tokenizer.json"
    if tok.is_file():
        meta["plait.tokenizer"] = tok.read_text()
    out = Path(out) if out else run_dir / "model.safetensors"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    publish(tmp, out)
    return out


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def _from_meta(path: Path, meta: dict) -> tuple[ModelConfig, DataSpec]:
    """The ModelConfig and DataSpec an exported file describes, checked as data (nothing is imported here)."""
    def obj(key: str) -> dict:
        try:
            value = json.loads(meta[key])
        except KeyError:
            raise CheckpointError(f"{path} has no {key} metadata; export it with `plait export RUN_DIR`") from None
        except (ValueError, RecursionError) as e:
            raise CheckpointError(f"{path}: metadata {key} is not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise CheckpointError(f"{path}: metadata {key} must be a JSON object")
        return value

    model, spec = obj("plait.model"), obj("plait.spec")
    for cls, key, value in ((ModelConfig, "plait.model", model), (DataSpec, "plait.spec", spec)):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise CheckpointError(f"{path}: metadata {key} has unknown keys {unknown[:5]} (written by another plait "
                                  "version?); export the run again with this one")
    if not isinstance(model.get("factory", ""), str) or not isinstance(model.get("options", {}), dict):
        raise CheckpointError(f"{path}: metadata plait.model has a malformed factory or options")
    shape = spec.get("input_shape", [])
    if not (isinstance(shape, list) and len(shape) <= 8
            and all(isinstance(d, int) and not isinstance(d, bool) and 0 < d <= 1 << 20 for d in shape)):
        raise CheckpointError(f"{path}: metadata plait.spec has a malformed input_shape {str(shape)[:60]}")
    return ModelConfig(**model), DataSpec(**spec)


def load_exported(path: str | Path, trust_factory: bool = False) -> tuple[nn.Module, dict]:
    """Rebuild the model from an exported file's metadata and load its weights; returns (model, metadata).

    A file whose metadata names a `model.factory` is refused unless `trust_factory` (the factory is code).
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            shapes = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    except Exception as e:  # safetensors' own error types for files that are not safetensors
        raise CheckpointError(f"{path} is not a readable safetensors file ({_first_line(e)})") from None
    if "plait.model" not in meta:
        raise CheckpointError(f"{path} has no plait metadata; export it with `plait export RUN_DIR`")
    model_cfg, spec = _from_meta(path, meta)
    if model_cfg.factory and not trust_factory:
        raise CheckpointError(f"{path} names model.factory = {model_cfg.factory!r}: building it would import and call "
                              "that code with the options the file gives; pass --trust-factory only if you trust both the "
                              "file and that code (files of registered models need no flag)")
    low_rank, int8 = _compressed(path, meta, shapes)  # `plait compress` files: their layers' structure and scales
    adapters = _adapters(path, meta)
    try:
        with torch.device("meta"):  # shapes first: a file cannot make plait allocate a model larger than it holds
            skeleton = with_adapters(with_low_rank_structure(build_model(model_cfg, spec), low_rank), adapters).state_dict()
    except PlaitError as e:
        raise CheckpointError(f"{path}: its metadata does not describe a model plait can build ({e})") from None
    except Exception as e:
        raise CheckpointError(f"{path}: its metadata does not describe a model plait can build ({_first_line(e)})") from None
    _check_tensors(path, skeleton, shapes)
    try:
        model = with_adapters(with_low_rank_structure(build_model(model_cfg, spec), low_rank), adapters)
    except PlaitError as e:
        raise CheckpointError(f"{path}: the model cannot be built ({e})") from None
    except Exception as e:
        raise CheckpointError(f"{path}: the model cannot be built ({_first_line(e)})") from None
    tensors = _load_tensors(path)
    for layer in int8:  # int8 weights and per-row scales back to the float weights they stand for
        tensors[f"{layer}.weight"] = tensors[f"{layer}.weight"].float() * tensors.pop(f"{layer}.weight_scale")
    model.load_state_dict(tensors)
    if int8:
        _requantize(model, int8)
    return model, meta


def _adapters(path: Path, meta: dict) -> tuple[int, list[str]] | None:
    """(size, layer names) of a run's bottleneck adapters (finetune.adapters), kept in the file as modules."""
    if "plait.adapters" not in meta:
        return None
    try:
        a = json.loads(meta["plait.adapters"])
        size, layers = a["size"], a["layers"]
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{path}: malformed plait.adapters metadata; export the run again") from None
    if not (isinstance(size, int) and 0 < size <= 1 << 16 and isinstance(layers, list)
            and all(isinstance(x, str) for x in layers)):
        raise CheckpointError(f"{path}: malformed plait.adapters metadata; export the run again")
    return size, layers


def with_adapters(model: nn.Module, adapters: tuple[int, list[str]] | None) -> nn.Module:
    if adapters is not None:
        size, layers = adapters
        try:
            apply_adapters(model, size, layers)
        except (AttributeError, TypeError) as e:
            raise CheckpointError(f"plait.adapters names layers this model does not have ({_first_line(e)})") from None
    return model


def _compressed(path: Path, meta: dict, shapes: dict) -> tuple[dict[str, int], list[str]]:
    """What `plait compress` recorded: low-rank layers and their ranks; int8 layers (their scales leave `shapes`)."""
    try:
        low_rank = json.loads(meta.get("plait.low_rank", "{}"))
        int8 = json.loads(meta["plait.quantize"])["layers"] if "plait.quantize" in meta else []
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{path}: malformed plait.low_rank / plait.quantize metadata; compress the run again") from None
    if not (isinstance(low_rank, dict) and all(isinstance(k, str) and isinstance(v, int) and 0 < v <= 1 << 16
                                               for k, v in low_rank.items())
            and isinstance(int8, list) and all(isinstance(x, str) for x in int8)):
        raise CheckpointError(f"{path}: malformed plait.low_rank / plait.quantize metadata; compress the run again")
    for layer in int8:
        if f"{layer}.weight_scale" not in shapes or f"{layer}.weight" not in shapes:
            raise CheckpointError(f"{path}: int8 layer {layer} has no weight or weight_scale tensor")
        shapes.pop(f"{layer}.weight_scale")
        shape, _ = shapes[f"{layer}.weight"]
        shapes[f"{layer}.weight"] = (shape, "F32")
    return low_rank, int8


def _requantize(model: nn.Module, layers: list[str]) -> None:
    """Serve int8 layers as int8 (torchao weight-only) when torchao is installed; as their float values otherwise."""
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError:
        return
    quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: fqn in layers)


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


def _check_tensors(path: Path, skeleton: dict, stored: dict) -> None:
    """The file's tensor names, shapes and dtypes against the model's (built on the meta device)."""
    want, have = set(skeleton), set(stored)
    if want != have:
        missing, extra = sorted(want - have), sorted(have - want)
        raise CheckpointError(f"{path} does not fit its model: missing tensors {missing[:3]}, unexpected {extra[:3]}")
    for name, t in skeleton.items():
        shape, dtype = stored[name]
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{path}: tensor {name} has shape {list(shape)}, the model's is {list(t.shape)}")
        if _SAFETENSORS_DTYPES.get(str(dtype)) != t.dtype:
            raise CheckpointError(f"{path}: tensor {name} has dtype {dtype}, the model's is {str(t.dtype).removeprefix('torch.')}")


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except Exception as e:
        raise CheckpointError(f"{path} cannot be read ({_first_line(e)})") from None
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{path}: tensor {name} holds NaN or Inf; refusing to serve a model with broken weights")
    return tensors


__all__ = ["export", "load_exported", "rebuild_model"]


# plait.export(run_dir, out) calls the API's export (docs/api.md): this module is the package's `export` attribute.
sys.modules[__name__].__class__ = CallableModule


def _gpt2_to_hf(m, state: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """GPT2LMHeadModel's config.json and tensors of plait's GPT (the inverse of plait.models.hf.hf_state_dict)."""
    if m.moe_experts:
        raise ConfigError("a GPT with mixture-of-experts blocks has no transformers class; export it with "
                          "--format safetensors")
    act = {"gelu_tanh": "gelu_new", "gelu": "gelu"}[m.activation]
    vocab = m.vocab_size or state["tok_emb.weight"].shape[0]  # the padded rows stay behind
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": m.width, "n_layer": m.layers,
              "n_head": m.heads, "n_positions": m.context, "n_ctx": m.context, "vocab_size": vocab,
              "activation_function": act, "layer_norm_epsilon": m.norm_eps, "tie_word_embeddings": m.tie_embeddings,
              "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "dtype": "float32"}
    out = {"transformer.wte.weight": state["tok_emb.weight"][:vocab], "transformer.wpe.weight": state["pos_emb.weight"],
           "transformer.ln_f.weight": state["ln_f.weight"], "transformer.ln_f.bias": state["ln_f.bias"]}
    if not m.tie_embeddings:
        out["lm_head.weight"] = state["head.weight"][:vocab]
    for i in range(m.layers):
        h, b = f"transformer.h.{i}.", f"blocks.{i}."
        out[h + "attn.c_attn.weight"] = torch.cat([state[b + f"attn.{p}.weight"] for p in "qkv"]).t()
        out[h + "attn.c_attn.bias"] = torch.cat([state[b + f"attn.{p}.bias"] for p in "qkv"])
        for hf_name, name, transpose in (("ln_1", "ln1", False), ("ln_2", "ln2", False), ("attn.c_proj", "attn.proj", True),
                                         ("mlp.c_fc", "mlp.up", True), ("mlp.c_proj", "mlp.down", True)):
            w = state[b + name + ".weight"]
            out[h + hf_name + ".weight"] = w.t() if transpose else w
            out[h + hf_name + ".bias"] = state[b + name + ".bias"]
    return config, {k: v.detach().contiguous() for k, v in out.items()}


def export_hf(run_dir: str | Path, out: str | Path, checkpoint: str | Path | None = None, trust_checkpoint: bool = False,
              max_shard_bytes: int = 2 << 30) -> Path:
    """Write the run as a Hugging Face model directory (LoRA adapters merged): config.json, generation_config.json,
    safetensors shards with model.safetensors.index.json, and the tokenizer files; returns the directory.

    `transformers.AutoModelForCausalLM.from_pretrained(out)` then gives the run's logits. A llama becomes
    LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM or MixtralForCausalLM by its keys; a GPT, GPT2LMHeadModel.
    A run from a Hugging Face directory writes that checkpoint's own config.json, generation_config.json and
    tokenizer files back (plait.train.carried), changed only where the training changed them.
    """
    run_dir, out = Path(run_dir), Path(out)
    cfg, spec, model, ckpt = load_run_checkpoint(run_dir, checkpoint, trust_checkpoint)
    if cfg.model.factory or cfg.model.name not in ("llama", "gpt"):
        raise ConfigError(f"--format hf writes plait's llama and gpt models; {run_dir} trained "
                          f"{cfg.model.factory or cfg.model.name!r}: export it with --format safetensors")
    state = {k: v.detach().to("cpu") for k, v in merge_lora(model).state_dict().items()}
    m = dataclasses.replace(cfg.model, vocab_size=getattr(model, "vocab_size", 0) or cfg.model.vocab_size)
    source = Path(cfg.train.init_from) if cfg.train.init_from else None
    # the checkpoint's files: the run's copies, or (a run from before runs kept them) the source directory's
    own = carried_dir(run_dir) or (source if source is not None and is_hf_dir(source) else None)
    base = _json(own / "config.json") if own is not None else {}
    if m.name == "llama" and base.get("max_position_embeddings"):
        # rope has no learned positions: a shorter model.context bounded the training, not the model
        m = dataclasses.replace(m, context=int(base["max_position_embeddings"]))
    ours, tensors = to_hf(m, state) if m.name == "llama" else _gpt2_to_hf(m, state)
    # plait's keys describe the tensors written (the checkpoint's values, unless training changed them); the rest of
    # the checkpoint's config (eos_token_id, bos_token_id, what plait does not use) stays as it was
    config = {**{k: v for k, v in base.items() if k not in NOT_CARRIED}, **ours, "plait_checkpoint": ckpt.name}
    if "torch_dtype" in base:  # transformers 4's name for it
        config["torch_dtype"] = ours["dtype"]
    if out.exists() and not out.is_dir():
        raise ConfigError(f"-o {out} is a file; --format hf writes a directory: name a new or existing folder")
    out.mkdir(parents=True, exist_ok=True)
    _write_shards(out, tensors, max_shard_bytes)
    generation = _json(own / "generation_config.json") if own is not None else {}
    if not generation:  # transformers stops at the config's eos_token_id only when the generation config says it
        generation = {"do_sample": False, "max_length": cfg.model.context,
                      **{k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}}
    for fname, obj in (("config.json", config), ("generation_config.json", generation)):
        tmp = out / (fname + ".tmp")
        tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
        publish(tmp, out / fname)
    for fname in TOKENIZER_FILES:
        for where in (own, run_dir, source):
            if where is not None and where.is_dir() and (where / fname).is_file():
                shutil.copyfile(where / fname, out / fname)
                break
    return out


# what the checkpoint's config says of tensors and code the export does not have: its own quantized format, and
# classes of its own (remote code, which plait never imports and does not copy)
NOT_CARRIED = ("quantization_config", "auto_map")
TOKENIZER_FILES = tuple(f for f in CARRIED if f not in ("config.json", "generation_config.json"))


def _json(path: Path) -> dict:
    """A carried JSON file ({} when it is missing); one that does not parse names itself."""
    if not path.is_file():
        return {}
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not JSON ({e.msg} at line {e.lineno}); repair or remove it") from None
    if not isinstance(found, dict):
        raise CheckpointError(f"{path} is not a JSON object; repair or remove it")
    return found


def _write_shards(out: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> None:
    """Safetensors shards of at most max_shard_bytes each (a tensor larger than that alone) and their index."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.clone()
        size += nbytes
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tmp = out / (fname + ".tmp")
        save_file(shard, str(tmp), metadata={"format": "pt"})
        publish(tmp, out / fname)
        weight_map.update(dict.fromkeys(shard, fname))
        total += sum(t.numel() * t.element_size() for t in shard.values())
    tmp = out / "model.safetensors.index.json.tmp"
    tmp.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n",
                   encoding="utf-8")
    publish(tmp, out / "model.safetensors.index.json")
