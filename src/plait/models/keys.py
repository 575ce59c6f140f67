"""The [model] section: the registry's names, what each registered model can do, and each one's keys. Torch-free.

MODELS names every registered model and where its builder lives ('module:function', imported when
one is built, plait.models.registry); model.name's description and error messages list these names.
CAPABILITIES and DATA_FOR say what each can do and train on, and check_config checks the section
against them: the job check reads them without importing torch (a user's factory is asked in
plait.models.registry, which builds it on the meta device).
"""

from __future__ import annotations

import math

from plait.config import keys, opt
from plait.errors import ConfigError

MODELS = {"gpt": "plait.models.gpt:build_gpt", "mlp": "plait.models.mlp:build_mlp", "cnn": "plait.models.cnn:build_cnn",
          "deepfm": "plait.models.deepfm:build_deepfm", "llama": "plait.models.llama:build_llama",
          "vlm": "plait.models.vlm:build_vlm"}

# What the registered models can do beyond data parallelism (a user's model is asked: plait.models.registry.capabilities).
CAPABILITIES: dict[str, frozenset[str]] = {"gpt": frozenset({"pipeline", "tensor_parallel"}),
                                           "llama": frozenset({"pipeline", "tensor_parallel"}),
                                           "deepfm": frozenset({"pipeline", "tensor_parallel"})}
# The data each registered model trains on.
DATA_FOR = {"gpt": ("stdlib-text", "text", "chat", "preference"), "llama": ("stdlib-text", "text", "chat", "preference"),
            "deepfm": ("clicks",),
            "vlm": ("digit-captions",)}


def check_config(model_cfg, data_name: str) -> None:
    """The [model] section against the registry and the data it would train on; ConfigError naming the fix."""
    if model_cfg.factory:
        if ":" not in model_cfg.factory:
            raise ConfigError(f"model.factory = {model_cfg.factory!r} must be 'package.module:function'")
        return
    if model_cfg.name not in MODELS:
        raise ConfigError(
            f"model.name = {model_cfg.name!r} is not a registered model; choose one of: {', '.join(sorted(MODELS))}, "
            "or set model.factory = 'package.module:function'")
    if model_cfg.name in ("gpt", "llama"):
        for key in ("layers", "heads", "width", "context"):
            if getattr(model_cfg, key) < 1:
                raise ConfigError(f"model.{key} = {getattr(model_cfg, key)} must be >= 1; set --set model.{key}=<value >= 1>")
        if model_cfg.width % model_cfg.heads:
            raise ConfigError(
                f"model.width ({model_cfg.width}) must be divisible by model.heads ({model_cfg.heads}); "
                f"change one of them (e.g. width={model_cfg.heads * max(1, round(model_cfg.width / model_cfg.heads))})")
        if model_cfg.name == "llama" and model_cfg.kv_heads and model_cfg.heads % model_cfg.kv_heads:
            raise ConfigError(f"model.heads ({model_cfg.heads}) must be a multiple of model.kv_heads "
                              f"({model_cfg.kv_heads}): each kv head serves a group of query heads")
        check_moe(model_cfg)
    elif model_cfg.moe_experts:
        raise ConfigError(f"model.moe_experts = {model_cfg.moe_experts} makes the gpt's blocks mixtures of experts; "
                          f"model.name = {model_cfg.name!r} has none: set model.moe_experts=0 (a model of your own can "
                          "use plait.models.moe.MoE through model.factory)")
    token_data = data_name in ("stdlib-text", "text", "chat", "preference")
    text = "a text source (stdlib-text, text or chat)"
    wants = {"gpt": text, "llama": text, "deepfm": "data.name = 'clicks'", "vlm": "data.name = 'digit-captions'"}.get(
        model_cfg.name, "digits, synthetic or tensors")
    own = ("clicks", "digit-captions")  # data only their own model reads
    fits = data_name in DATA_FOR[model_cfg.name] if model_cfg.name in DATA_FOR else not token_data and data_name not in own
    if not fits:
        raise ConfigError(f"model.name = {model_cfg.name!r} cannot train on data.name = {data_name!r}: it needs {wants}; "
                          "change model.name or data.name")


def check_moe(model_cfg) -> None:
    """The gpt's mixture-of-experts keys (model.moe_*)."""
    m = model_cfg
    if m.moe_experts < 0:
        raise ConfigError(f"model.moe_experts = {m.moe_experts} must be >= 0 (0: dense blocks)")
    for key in ("moe_capacity_factor", "moe_aux_weight"):
        value = getattr(m, key)
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"model.{key} = {value} must be a finite number >= 0")
    if not m.moe_experts:
        return
    if not 1 <= m.moe_top_k <= m.moe_experts:
        raise ConfigError(f"model.moe_top_k = {m.moe_top_k} must be between 1 and model.moe_experts = {m.moe_experts}; "
                          f"set --set model.moe_top_k={min(max(1, m.moe_top_k), m.moe_experts)}")
    if not 1 <= m.moe_every <= m.layers:
        raise ConfigError(f"model.moe_every = {m.moe_every} must be between 1 and model.layers = {m.layers} (every "
                          "k-th block is a mixture of experts); set --set model.moe_every=1")


@keys("model")
class ModelKeys:
    name: str = opt("gpt", f"registered model: {', '.join(MODELS)} (ignored when factory is set)")
    factory: str = opt("", "'package.module:function' returning your own nn.Module; called with **options")
    options: dict = opt({}, "keyword arguments passed to the factory")
    hf_class: str = opt("", "a transformers class (AutoModelForSequenceClassification, BertForSequenceClassification, "
                            "AutoModelForCausalLM, ...) built from train.init_from's config.json and loaded with its "
                            "weights; a classification head takes the data's classes")


@keys("model")
class GPTKeys:
    layers: int = opt(4, "gpt: number of transformer blocks")
    heads: int = opt(4, "gpt: attention heads per block (must divide width)")
    width: int = opt(128, "gpt: embedding width d_model; mlp/cnn: hidden width", minimum=1)
    context: int = opt(128, "gpt: context length in tokens (the training sequence length)")
    vocab_size: int = opt(0, "gpt: vocabulary size; 0 takes the data's tokenizer size")
    tie_embeddings: bool = opt(True, "gpt: share the token embedding with the output head")
    activation: str = opt("gelu", "gpt: the dense blocks' GELU: exact, or gelu_tanh (the tanh approximation of GPT-2)",
                          ("gelu", "gelu_tanh"))
    norm_eps: float = opt(1e-5, "gpt: epsilon of every LayerNorm")
    dropout: float = opt(0.0, "dropout probability (0 keeps trajectories layout-independent)")

    def check(self, cfg) -> None:
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout = {self.dropout} must be in [0, 1)")


@keys("model")
class LlamaKeys:
    kv_heads: int = opt(0, "llama: key/value heads (grouped-query attention; 1: multi-query; 0: model.heads)", minimum=0)
    hidden: int = opt(0, "llama: SwiGLU feed-forward width (intermediate_size; 0: 4 * width)", minimum=0)
    rope_theta: float = opt(10000.0, "llama: rotary base", above=0.0, finite=True)
    rope_scaling: dict = opt({}, "llama: Hugging Face's rope scaling, {rope_type = 'linear' | 'dynamic' | 'llama3', "
                                 "factor = ..., ...} ({}: none)")
    attn_bias: str = opt("none", "llama: biases of the attention projections (qkv: Qwen2; all: q/k/v/o)",
                         ("none", "qkv", "all"))
    sliding_window: int = opt(0, "llama: each token attends to at most this many positions back (Mistral; 0: all)",
                              minimum=0)
    vocab_multiple: int = opt(0, "gpt and llama: the embedding and head are padded to a multiple of this (every tp "
                                 "degree that divides it splits them; the padding is never in a loss or sampled); 0: "
                                 "the model's default, 64 for llama and for a GPT-2 checkpoint, 1 (none) for gpt",
                              minimum=0)

    def check(self, cfg) -> None:
        kind = self.rope_scaling.get("rope_type", "default") if self.rope_scaling else "default"
        need = {"linear": ("factor",), "dynamic": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
        if kind not in ("default", *need):
            raise ConfigError(f"model.rope_scaling.rope_type = {kind!r} is not supported; choose linear, dynamic or llama3")
        missing = [k for k in need.get(kind, ()) if k not in self.rope_scaling]
        if missing:
            raise ConfigError(f"model.rope_scaling with rope_type = {kind!r} needs {', '.join(missing)}")


@keys("model")
class SmallModelKeys:
    depth: int = opt(2, "mlp and deepfm: hidden layers; cnn: convolution blocks", minimum=1)
    embedding_dim: int = opt(8, "deepfm: embedding width per categorical field", minimum=1)
    patch_size: int = opt(0, "cnn: patch gradient descent on large images (plait.models.patchgd): the blocks see "
                             "patch_size x patch_size patches, a head classifies the grid of their vectors (0: the "
                             "whole image at once)", minimum=0)
    patch_grad: int = opt(0, "cnn with patch_size: patches back-propagated per step (the rest fill the latent without "
                             "gradients; activation memory is that of these patches); 0: every patch", minimum=0)

    def check(self, cfg) -> None:
        if self.patch_size and cfg.model.name != "cnn":
            raise ConfigError(f"model.patch_size = {self.patch_size} is patch gradient descent for model.name = 'cnn'; "
                              f"model.name is {cfg.model.name!r}: set model.patch_size=0")
        if self.patch_grad and not self.patch_size:
            raise ConfigError(f"model.patch_grad = {self.patch_grad} needs model.patch_size (the patches' side)")
        if self.patch_size and cfg.parallel.pp > 1:
            raise ConfigError(f"model.patch_size with parallel.pp = {cfg.parallel.pp}: the patch model has no "
                              "pipeline cut; use dp or ZeRO")


@keys("model")
class MoEKeys:
    moe_experts: int = opt(0, "gpt: experts per mixture-of-experts block (0: dense feed-forward blocks)")
    moe_top_k: int = opt(1, "gpt MoE: experts each token is routed to (1: Switch; 2: GShard, Mixtral)")
    moe_every: int = opt(1, "gpt MoE: every k-th block is a mixture of experts (1: all; 2: blocks 1, 3, ...)")
    moe_capacity_factor: float = opt(0.0, "gpt MoE: training capacity per expert and sequence = factor * tokens * "
                                          "top_k / experts; extra assignments are dropped (0: dropless)")
    moe_aux_weight: float = opt(0.01, "gpt MoE: weight of the Switch load-balancing loss added to the training loss")


@keys("model")
class VLMKeys:
    connector: str = opt("projection", "vlm: how image tokens reach the language model: projection (LLaVA: projected "
                                       "into the token stream), cross_attention (Flamingo: tanh-gated cross-attention "
                                       "layers, gates at zero) or qformer (BLIP-2: learned queries attend to the image)",
                         ("projection", "cross_attention", "qformer"))
    vlm_queries: int = opt(8, "vlm with connector = qformer: learned query tokens", minimum=1)


@keys("model")
class ContrastiveKeys:
    projection_dim: int = opt(32, "train.objective = contrastive: width of the projection head on top of the encoder",
                              minimum=1)


@keys("model")
class EnsembleKeys:
    ensemble: int = opt(1, "members of a deep ensemble trained together on the same batches, member k from the init "
                           "seed + k; evaluation, export and serving average their probabilities (serving adds their "
                           "spread); 1: one model", minimum=1)

    def check(self, cfg) -> None:
        if self.ensemble == 1:
            return
        p = cfg.parallel
        other = [f"parallel.{k} = {getattr(p, k)}" for k in ("pp", "tp", "ep", "cp") if getattr(p, k) > 1]
        if other:
            raise ConfigError(f"model.ensemble = {self.ensemble} with {', '.join(other)}: an ensemble trains with dp and "
                              "ZeRO (every rank runs every member on its share of the batch); set them to 1")
        if cfg.train.objective != "supervised":
            raise ConfigError(f"model.ensemble = {self.ensemble} with train.objective = {cfg.train.objective!r}: "
                              "ensembles are supervised; set model.ensemble=1")
