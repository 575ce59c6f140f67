"""The [model] section: the registry's names and each registered model's keys. Torch-free.

MODELS names every registered model and where its builder lives ('module:function', imported when
one is built, plait.models.registry); model.name's description and error messages list these names.
"""

from __future__ import annotations

from plait.config import keys, opt
from plait.errors import ConfigError

MODELS = {"gpt": "plait.models.gpt:build_gpt", "mlp": "plait.models.mlp:build_mlp", "cnn": "plait.models.cnn:build_cnn",
          "deepfm": "plait.models.deepfm:build_deepfm"}


@keys("model")
class ModelKeys:
    name: str = opt("gpt", f"registered model: {', '.join(MODELS)} (ignored when factory is set)")
    factory: str = opt("", "'package.module:function' returning your own nn.Module; called with **options")
    options: dict = opt({}, "keyword arguments passed to the factory")


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
class SmallModelKeys:
    depth: int = opt(2, "mlp and deepfm: hidden layers; cnn: convolution blocks", minimum=1)
    embedding_dim: int = opt(8, "deepfm: embedding width per categorical field", minimum=1)


@keys("model")
class MoEKeys:
    moe_experts: int = opt(0, "gpt: experts per mixture-of-experts block (0: dense feed-forward blocks)")
    moe_top_k: int = opt(1, "gpt MoE: experts each token is routed to (1: Switch; 2: GShard, Mixtral)")
    moe_every: int = opt(1, "gpt MoE: every k-th block is a mixture of experts (1: all; 2: blocks 1, 3, ...)")
    moe_capacity_factor: float = opt(0.0, "gpt MoE: training capacity per expert and sequence = factor * tokens * "
                                          "top_k / experts; extra assignments are dropped (0: dropless)")
    moe_aux_weight: float = opt(0.01, "gpt MoE: weight of the Switch load-balancing loss added to the training loss")


@keys("model")
class ContrastiveKeys:
    projection_dim: int = opt(32, "train.objective = contrastive: width of the projection head on top of the encoder",
                              minimum=1)
