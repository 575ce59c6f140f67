"""Hugging Face checkpoints on plait's models: a directory with config.json and model.safetensors (or shards).

GPT-2 checkpoints load into plait's GPT; Llama, Qwen2, Mistral and Mixtral into plait's llama
(plait.models.hf_llama holds their mapping and the way back out).

    is_hf_dir(path)                          # config.json and no plait config.toml
    apply_hf_config(cfg.model, cfg.data, d)  # [model] from config.json (an override that conflicts is an error)
    tensors = hf_state_dict(d, context)      # the weights under the GPT's names, ready for load_state_dict

GPT-2 is plait's GPT with the tanh-approximated GELU: its Conv1D weights are (in, out), so they are
transposed, and its fused c_attn (q | k | v along the output) is split into the separate q, k and v
projections. The head is tied to the token embedding unless config.json says otherwise. A shorter
model.context than n_positions keeps the first learned positions. `tokenizer.json`, when present, is
the data's and the server's tokenizer (plait.data.hf_tokenizer).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from plait.config import DataConfig, ModelConfig
from plait.data.hf_tokenizer import HFTokenizer
from plait.data.spec import DataSpec
from plait.errors import ConfigError
from plait.models.hf_llama import FAMILY, MODEL_TYPES, llama_model_keys, llama_state_dict
from plait.models.lazy import Lazy, confined, open_weights
from plait.models.registry import build_model

ARCHITECTURES = ("GPT2LMHeadModel", "GPT2Model")
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
IGNORED = re.compile(r"(^|\.)attn\.(masked_)?bias$")  # causal-mask buffers some GPT-2 checkpoints carry
DEFAULTS = {"n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
            "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new", "tie_word_embeddings": True}


def _where(key: str, path) -> str:
    """What the message is about: `train.init_from = 'DIR'` (a config key) or `plait serve 'DIR'` (a command)."""
    return f"{key} {str(path)!r}" if key.startswith("plait") else f"{key} = {str(path)!r}"


def is_hf_dir(path: str | Path) -> bool:
    """A Hugging Face model directory (config.json), not a plait run directory (config.toml)."""
    path = Path(path)
    return path.is_dir() and (path / "config.json").is_file() and not (path / "config.toml").is_file()


def read_hf_config(path: str | Path, key: str = "train.init_from") -> dict:
    """config.json of a supported architecture, with GPT-2's defaults for keys it leaves out."""
    path = Path(path)
    where = _where(key, path)
    try:
        raw = json.loads(confined(path, "config.json", where).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(f"{where}: config.json is not readable JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: config.json must be a JSON object")
    try:
        cfg = _supported(raw, where)
        hf_model_keys(cfg)  # every field plait takes is there and of its type
    except (TypeError, KeyError, ValueError, AttributeError, IndexError, OverflowError, ZeroDivisionError) as e:
        raise ConfigError(f"{where}: config.json has a missing or malformed field ({type(e).__name__}: "
                          f"{str(e)[:120]})") from None
    return cfg


def _supported(raw: dict, where: str) -> dict:
    """config.json of an architecture plait loads, with the flags plait's models lack refused."""
    archs = raw.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else raw.get("model_type", "(none given)")
    if arch in FAMILY or (not archs and arch in MODEL_TYPES):
        raw["_plait"] = "llama"
        llama_model_keys(raw, where)  # refuses a flag plait's llama lacks
        return raw
    if arch not in ARCHITECTURES and not (not archs and arch == "gpt2"):
        raise ConfigError(f"{where}: architecture {arch!r} is not supported; plait loads {', '.join(FAMILY)} and "
                          f"GPT-2-family checkpoints ({', '.join(ARCHITECTURES)}: gpt2, distilgpt2, ...)")
    cfg = {**DEFAULTS, **raw}
    act = cfg["activation_function"]
    if act not in ACTIVATIONS:
        raise ConfigError(f"{where}: activation_function {act!r} is not supported; plait's GPT has "
                          f"{', '.join(ACTIVATIONS)}")
    if cfg.get("n_inner") not in (None, 4 * cfg["n_embd"]):
        raise ConfigError(f"{where}: n_inner = {cfg['n_inner']} but plait's GPT has a 4 * n_embd = {4 * cfg['n_embd']} "
                          "feed-forward width")
    for flag, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                       ("add_cross_attention", False)):
        if cfg.get(flag, want) != want:
            raise ConfigError(f"{where}: {flag} = {cfg[flag]} is not supported by plait's GPT (it needs {want})")
    return cfg


def hf_model_keys(hf: dict) -> dict:
    """The [model] keys config.json fixes: {key: (value, the config.json name it comes from)}."""
    if hf.get("_plait") == "llama":
        return llama_model_keys(hf, "config.json")
    return {"name": ("gpt", "architecture"), "layers": (int(hf["n_layer"]), "n_layer"),
            "heads": (int(hf["n_head"]), "n_head"), "width": (int(hf["n_embd"]), "n_embd"),
            "vocab_size": (int(hf["vocab_size"]), "vocab_size"),
            "tie_embeddings": (bool(hf["tie_word_embeddings"]), "tie_word_embeddings"),
            "activation": (ACTIVATIONS[hf["activation_function"]], "activation_function"),
            "norm_eps": (float(hf["layer_norm_epsilon"]), "layer_norm_epsilon")}


def apply_hf_config(model_cfg, data_cfg, path: str | Path, key: str = "train.init_from") -> None:
    """Set the [model] section from config.json (and data.tokenizer from tokenizer.json, when there is one).

    A key left at its default takes the checkpoint's value; one set to another value is an error naming
    both, except model.context, which may be shorter than n_positions (the first positions are kept).
    """
    hf = read_hf_config(path, key)
    where = _where(key, path)
    default = ModelConfig()
    llama = hf.get("_plait") == "llama"
    if model_cfg.factory:
        raise ConfigError(f"{where} is a {hf.get('architectures', ['GPT-2'])[0]} checkpoint, but model.factory = "
                          f"{model_cfg.factory!r} builds another model; unset model.factory")
    if model_cfg.moe_experts and not llama:
        raise ConfigError(f"{where} is a dense GPT-2 checkpoint; set model.moe_experts=0")
    for name, (value, hf_name) in hf_model_keys(hf).items():
        have = getattr(model_cfg, name)
        if have != value and have != getattr(default, name):
            shown = (hf.get("architectures") or ["GPT2LMHeadModel"])[0] if name == "name" else hf.get(hf_name, value)
            raise ConfigError(f"model.{name} = {have!r} conflicts with {hf_name} = {shown!r} in {Path(path) / 'config.json'}"
                              f"; drop the model.{name} override (the checkpoint sets it)")
        setattr(model_cfg, name, value)
    if not llama and not model_cfg.vocab_multiple:  # GPT-2's 50257 rows: padded so that tp can split them
        model_cfg.vocab_multiple = 64
    n_pos = int(hf["max_position_embeddings"] if llama else hf["n_positions"])
    if model_cfg.context == default.context:
        model_cfg.context = n_pos
    elif model_cfg.context > n_pos:
        raise ConfigError(f"model.context = {model_cfg.context} conflicts with n_positions = {n_pos} in "
                          f"{Path(path) / 'config.json'}: the checkpoint has no positions beyond it; set "
                          f"model.context <= {n_pos}")
    tok = confined(Path(path), "tokenizer.json", _where(key, path))
    confined(Path(path), "tokenizer_config.json", _where(key, path))  # the chat template beside it
    if tok.is_file() and not data_cfg.tokenizer:
        data_cfg.tokenizer = str(tok)


def hf_state_dict(path: str | Path, context: int | None = None, key: str = "train.init_from",
                  rows: int | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors renamed and reshaped to plait's model (GPT positions cut to `context` when given;
    a llama's vocabulary padded to `rows`)."""
    return {k: v.full().contiguous() for k, v in hf_lazy_state_dict(path, context, key, rows).items()}


def hf_lazy_state_dict(path: str | Path, context: int | None = None, key: str = "train.init_from",
                       rows: int | None = None) -> dict[str, Lazy]:
    """hf_state_dict with nothing read yet: {plait name: Lazy} (plait.models.lazy), for a rank to read its slices."""
    path = Path(path)
    where = _where(key, path)
    hf = read_hf_config(path, key)
    if hf.get("_plait") == "llama":
        return _llama_tensors(path, where, hf, rows or int(hf["vocab_size"]))
    src = {k.removeprefix("transformer."): v for k, v in open_weights(path, where).items() if not IGNORED.search(k)}

    def take(name: str) -> Lazy:
        if name not in src:
            raise ConfigError(f"{where} does not hold a GPT-2 checkpoint: tensor {name} is missing (it has "
                              f"{len(src)} tensors, e.g. {list(src)[:3]})")
        return src.pop(name)

    wte, wpe = take("wte.weight"), take("wpe.weight")
    _same_vocabulary(where, hf["vocab_size"], wte)
    out = {"tok_emb.weight": wte.pad_rows(rows or wte.shape[0]),
           "pos_emb.weight": wpe.rows(0, context) if context else wpe}
    for i in range(hf["n_layer"]):
        h, b = f"h.{i}.", f"blocks.{i}."
        q, k, v = take(h + "attn.c_attn.weight").t().chunk(3)  # Conv1D (in, 3 out) -> three Linear (out, in)
        qb, kb, vb = take(h + "attn.c_attn.bias").chunk(3)
        out.update({b + "attn.q.weight": q, b + "attn.k.weight": k, b + "attn.v.weight": v,
                    b + "attn.q.bias": qb, b + "attn.k.bias": kb, b + "attn.v.bias": vb})
        for hf_name, name, transpose in (("ln_1", "ln1", False), ("ln_2", "ln2", False), ("attn.c_proj", "attn.proj", True),
                                         ("mlp.c_fc", "mlp.up", True), ("mlp.c_proj", "mlp.down", True)):
            w = take(h + hf_name + ".weight")
            out[b + name + ".weight"] = w.t() if transpose else w
            out[b + name + ".bias"] = take(h + hf_name + ".bias")
    out["ln_f.weight"], out["ln_f.bias"] = take("ln_f.weight"), take("ln_f.bias")
    lm_head = src.pop("lm_head.weight", None)
    if hf["tie_word_embeddings"]:
        out["head.weight"] = out["tok_emb.weight"]
    elif lm_head is None:
        raise ConfigError(f"{where}: config.json has tie_word_embeddings = false but there is no lm_head.weight")
    else:
        out["head.weight"] = lm_head.pad_rows(rows or lm_head.shape[0])
    if src:
        raise ConfigError(f"{where} has tensors plait's GPT does not, first {next(iter(src))}; is it a GPT-2 checkpoint?")
    return out


def hf_native_parts(path: str | Path, model, key: str = "train.init_from") -> tuple[dict[str, Lazy], list[str]]:
    """({name: Lazy}, names left at their fresh values) of a directory for a transformers model built from its
    config.json (model.hf_class): the tensors under their own names (a base model's saved without its prefix get
    it), shapes checked. What the checkpoint lacks outside the base model (a new classification head) keeps its
    fresh weights; a base-model tensor it lacks is an error, and tensors the model has no place for (a
    pre-training head) are left out."""
    path = Path(path)
    where = _where(key, path)
    src = open_weights(path, where)
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and not any(k.startswith(prefix + ".") for k in src):  # saved from the base model alone
        src = {f"{prefix}.{k}": v for k, v in src.items()}
    params = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    buffers = {n: tuple(b.shape) for n, b in model.state_dict().items() if n not in params}
    fresh = [n for n in params if n not in src]
    base = [n for n in fresh if prefix and n.startswith(prefix + ".")]
    if base:
        raise ConfigError(f"{key} = {str(path)!r} does not fit {type(model).__name__}: tensor {base[0]} is missing from "
                          f"it (it has {len(src)} tensors, e.g. {list(src)[:3]}); is it a checkpoint of this "
                          "architecture?")
    for name, shape in {**params, **buffers}.items():
        if name in src and tuple(src[name].shape) != shape:
            raise ConfigError(f"{key} = {str(path)!r} does not fit {type(model).__name__}: tensor {name} has shape "
                              f"{list(src[name].shape)} there and {list(shape)} in the model (a classifier: the "
                              "checkpoint's labels against the data's classes); change the data or the checkpoint")
    return {n: src[n] for n in {**params, **buffers} if n in src}, fresh


def _same_vocabulary(where: str, vocab_size, embedding: Lazy | None) -> None:
    """config.json's vocab_size is the embedding's rows (the model pads past them, never beyond config.json's)."""
    if embedding is not None and embedding.shape[0] != int(vocab_size):
        raise ConfigError(f"{where}: config.json's vocab_size = {vocab_size} but the weights' token embedding has "
                          f"{embedding.shape[0]} rows; config.json does not describe these weights")


def _llama_tensors(path: Path, where: str, hf: dict, rows: int) -> dict[str, Lazy]:
    src = {k: v for k, v in open_weights(path, where).items() if not k.endswith("rotary_emb.inv_freq")}

    def take(name: str) -> Lazy:
        if name not in src:
            raise ConfigError(f"{where} does not hold a {hf['architectures'][0]} checkpoint: tensor {name} is missing "
                              f"(it has {len(src)} tensors, e.g. {list(src)[:3]})")
        return src.pop(name)

    _same_vocabulary(where, hf["vocab_size"], src.get("model.embed_tokens.weight"))
    out = llama_state_dict(take, src.__contains__, hf, rows)
    if src:
        raise ConfigError(f"{where} has tensors plait's llama does not, first {next(iter(src))}; does config.json "
                          "describe these weights?")
    return out


def check_shapes(model: torch.nn.Module, lazy: dict[str, Lazy], where: str) -> None:
    """ConfigError when a tensor the checkpoint's headers describe differs from the model's: config.json's sizes must
    be the weights' (an absurd hidden_size or vocab_size is refused here, before a model of that size is allocated)."""
    for name, t in model.state_dict().items():
        if name in lazy and tuple(lazy[name].shape) != tuple(t.shape):
            raise ConfigError(f"{where}: config.json makes {name} {list(t.shape)} but the weights hold "
                              f"{list(lazy[name].shape)}; config.json does not describe these weights")


def load_hf_model(path: str | Path, key: str = "plait serve"):
    """(model config, spec, model with the checkpoint's weights, tokenizer or None) for serving the directory."""

    path = Path(path)
    model_cfg, data_cfg = ModelConfig(), DataConfig()
    apply_hf_config(model_cfg, data_cfg, path, key)
    spec = DataSpec(name="huggingface", task="lm", input_shape=[model_cfg.context], vocab_size=model_cfg.vocab_size,
                    tokens_per_sample=model_cfg.context)
    hf_lazy_state_dict(path, model_cfg.context, key)  # every layer config.json names is in the weights, no more
    with torch.device("meta"):  # the shapes config.json implies, allocating nothing
        shapes = build_model(model_cfg, spec)
    lazy = hf_lazy_state_dict(path, model_cfg.context, key, shapes.tok_emb.weight.shape[0])
    check_shapes(shapes, lazy, _where(key, path))
    model = build_model(model_cfg, spec)
    model.load_state_dict({k: v.full().contiguous() for k, v in lazy.items()})
    tokenizer = None
    if data_cfg.tokenizer:
        tok = Path(data_cfg.tokenizer)
        tokenizer = HFTokenizer.from_json(tok.read_text(encoding="utf-8"), f"{_where(key, path)}: {tok.name}")
    return model_cfg, spec, model, tokenizer
