"""Hugging Face Llama-family checkpoints on plait's llama, in and out.

    keys = llama_model_keys(raw, where)        # [model] keys from a config.json: {key: (value, config.json name)}
    tensors = llama_state_dict(take, has, hf, rows)  # {plait name: Lazy} of the checkpoint (vocabulary padded)
    config, tensors = to_hf(model_cfg, state)   # config.json and tensors for transformers' from_pretrained

LlamaForCausalLM, Qwen2ForCausalLM (q/k/v biases), MistralForCausalLM (a sliding window) and
MixtralForCausalLM (top-k routed SwiGLU experts: per-expert w1/w3 (hidden, width) and w2 (width, hidden)
Linear weights, stacked here into plait.models.moe's (E, width, hidden) and (E, hidden, width)). Rope
parameters are read from transformers 5's `rope_parameters` or from 4's `rope_theta` and `rope_scaling`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from plait.errors import ConfigError
from plait.models.lazy import Lazy, stack

FAMILY = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral",
          "MixtralForCausalLM": "mixtral"}
MODEL_TYPES = {v: k for k, v in FAMILY.items()}


def rope_of(raw: dict) -> tuple[float, dict]:
    """(rope_theta, rope_scaling as plait keeps it: {} for none, else with rope_type)."""
    params = dict(raw.get("rope_parameters") or {})
    legacy = dict(raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = params or legacy
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    if kind in (None, "default"):
        return theta, {}
    return theta, {"rope_type": kind, **{k: v for k, v in scaling.items() if v is not None}}


def llama_model_keys(raw: dict, where: str) -> dict:
    """The [model] keys a Llama-family config.json fixes: {key: (value, the config.json name it comes from)}."""
    arch = raw["architectures"][0] if raw.get("architectures") else MODEL_TYPES[raw["model_type"]]
    family = FAMILY[arch]
    width, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act = {raw['hidden_act']!r} is not supported; plait's llama has SwiGLU (silu)")
    if raw.get("head_dim") not in (None, width // heads):
        raise ConfigError(f"{where}: head_dim = {raw['head_dim']} but plait's llama has hidden_size / "
                          f"num_attention_heads = {width // heads}")
    if raw.get("mlp_bias"):
        raise ConfigError(f"{where}: mlp_bias = true is not supported by plait's llama (its feed-forward has no biases)")
    bias = "qkv" if family == "qwen2" else ("all" if raw.get("attention_bias") else "none")
    window = int(raw.get("sliding_window") or 0)
    if family == "qwen2":
        if raw.get("use_sliding_window"):
            raise ConfigError(f"{where}: use_sliding_window = true (Qwen2's per-layer windows) is not supported; "
                              "plait's llama has one window for every layer")
        window = 0
    theta, scaling = rope_of(raw)
    keys = {"name": ("llama", "architecture"), "layers": (int(raw["num_hidden_layers"]), "num_hidden_layers"),
            "heads": (heads, "num_attention_heads"),
            "kv_heads": (int(raw.get("num_key_value_heads") or heads), "num_key_value_heads"),
            "width": (width, "hidden_size"), "hidden": (int(raw["intermediate_size"]), "intermediate_size"),
            "vocab_size": (int(raw["vocab_size"]), "vocab_size"),
            "tie_embeddings": (bool(raw.get("tie_word_embeddings", True)), "tie_word_embeddings"),
            "norm_eps": (float(raw.get("rms_norm_eps", 1e-6)), "rms_norm_eps"),
            "rope_theta": (theta, "rope_theta"), "rope_scaling": (scaling, "rope_scaling"),
            "attn_bias": (bias, "attention_bias"), "sliding_window": (window, "sliding_window")}
    if family == "mixtral":
        keys.update({"moe_experts": (int(raw["num_local_experts"]), "num_local_experts"),
                     "moe_top_k": (int(raw["num_experts_per_tok"]), "num_experts_per_tok"),
                     "moe_aux_weight": (float(raw.get("router_aux_loss_coef", 0.0)), "router_aux_loss_coef")})
        if raw.get("router_jitter_noise"):
            raise ConfigError(f"{where}: router_jitter_noise = {raw['router_jitter_noise']} is not supported (routing "
                              "must be a function of the token and the weights); set it to 0")
    return keys


def llama_state_dict(take: Callable[[str], Lazy], has: Callable[[str], bool], hf: dict, rows: int) -> dict[str, Lazy]:
    """The tensors under plait's llama names, unread (plait.models.lazy); `take(name)` pops a checkpoint tensor (an
    error when missing). The vocabulary's padding rows are zeros: no token looks them up and no logit shows them."""
    keys = {k: v for k, (v, _) in llama_model_keys(hf, "config.json").items()}
    out = {"tok_emb.weight": take("model.embed_tokens.weight").pad_rows(rows)}
    for i in range(keys["layers"]):
        h, b = f"model.layers.{i}.", f"blocks.{i}."
        out[b + "attn_norm.weight"] = take(h + "input_layernorm.weight")
        out[b + "mlp_norm.weight"] = take(h + "post_attention_layernorm.weight")
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"{b}attn.{p}.weight"] = take(f"{h}self_attn.{p}.weight")
            if has(f"{h}self_attn.{p}.bias"):
                out[f"{b}attn.{p}.bias"] = take(f"{h}self_attn.{p}.bias")
        if keys.get("moe_experts"):
            m = h + "block_sparse_moe."
            out[b + "mlp.router.weight"] = take(m + "gate.weight")
            for w in ("w1", "w2", "w3"):
                out[f"{b}mlp.{w}"] = stack([take(f"{m}experts.{e}.{w}.weight").t()
                                            for e in range(keys["moe_experts"])])
        else:
            for p in ("gate_proj", "up_proj", "down_proj"):
                out[f"{b}mlp.{p}.weight"] = take(f"{h}mlp.{p}.weight")
    out["norm.weight"] = take("model.norm.weight")
    if keys["tie_embeddings"]:
        if has("lm_head.weight"):
            take("lm_head.weight")
        out["head.weight"] = out["tok_emb.weight"]
    else:
        out["head.weight"] = take("lm_head.weight").pad_rows(rows)
    return out


def architecture(m) -> str:
    """The transformers class a llama with these [model] keys is."""
    if m.moe_experts:
        return "MixtralForCausalLM"
    if m.attn_bias == "qkv":
        if m.sliding_window:
            raise ConfigError("a llama with q/k/v biases (Qwen2) and a sliding window has no transformers class; "
                              "export it with --format safetensors")
        return "Qwen2ForCausalLM"
    return "MistralForCausalLM" if m.sliding_window else "LlamaForCausalLM"


def to_hf(m, state: dict[str, torch.Tensor], dtype: str = "float32") -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, tensors under the transformers names) of a llama's [model] keys and plain state dict."""
    arch = architecture(m)
    vocab = m.vocab_size
    config = {"architectures": [arch], "model_type": FAMILY[arch], "hidden_size": m.width,
              "intermediate_size": m.hidden or 4 * m.width, "num_hidden_layers": m.layers,
              "num_attention_heads": m.heads, "num_key_value_heads": m.kv_heads or m.heads,
              "head_dim": m.width // m.heads, "max_position_embeddings": m.context, "vocab_size": vocab,
              "rms_norm_eps": m.norm_eps, "tie_word_embeddings": m.tie_embeddings, "hidden_act": "silu",
              "rope_theta": m.rope_theta, "rope_scaling": dict(m.rope_scaling) or None, "dtype": dtype,
              "attention_dropout": 0.0, "use_cache": True}
    if arch == "LlamaForCausalLM":
        config.update({"attention_bias": m.attn_bias == "all", "mlp_bias": False})
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        config["sliding_window"] = m.sliding_window or None
    if arch == "Qwen2ForCausalLM":
        config.update({"use_sliding_window": False, "sliding_window": None})
    if arch == "MixtralForCausalLM":
        config.update({"num_local_experts": m.moe_experts, "num_experts_per_tok": m.moe_top_k,
                       "router_aux_loss_coef": m.moe_aux_weight, "router_jitter_noise": 0.0})
    out = {"model.embed_tokens.weight": state["tok_emb.weight"][:vocab], "model.norm.weight": state["norm.weight"]}
    if not m.tie_embeddings:
        out["lm_head.weight"] = state["head.weight"][:vocab]
    for i in range(m.layers):
        h, b = f"model.layers.{i}.", f"blocks.{i}."
        out[h + "input_layernorm.weight"] = state[b + "attn_norm.weight"]
        out[h + "post_attention_layernorm.weight"] = state[b + "mlp_norm.weight"]
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            for kind in ("weight", "bias"):
                if f"{b}attn.{p}.{kind}" in state:
                    out[f"{h}self_attn.{p}.{kind}"] = state[f"{b}attn.{p}.{kind}"]
        if m.moe_experts:
            out[h + "block_sparse_moe.gate.weight"] = state[b + "mlp.router.weight"]
            for w in ("w1", "w2", "w3"):
                for e, t in enumerate(state[f"{b}mlp.{w}"]):
                    out[f"{h}block_sparse_moe.experts.{e}.{w}.weight"] = t.t()
        else:
            for p in ("gate_proj", "up_proj", "down_proj"):
                out[f"{h}mlp.{p}.weight"] = state[f"{b}mlp.{p}.weight"]
    return config, {k: v.detach().to(getattr(torch, dtype)).contiguous() for k, v in out.items()}
