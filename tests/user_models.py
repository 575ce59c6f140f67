"""Models a user writes, for model.factory in tests (tests/ is on the path of every rank of the pool)."""

import torch.nn as nn
import torch.nn.functional as F

from plait.models.protocols import megatron_plan


def sequential(width: int = 32) -> nn.Sequential:
    """An MLP on 8x8 digits as an nn.Sequential: pipeline stages are cut between its children."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 10))


class Rows(nn.Module):
    """An 8x8 image as 8 tokens of 8 pixels."""

    def forward(self, x):
        return x.reshape(x.shape[0], 8, 8)


class Pool(nn.Module):
    def forward(self, x):
        return x.mean(1)


class Block(nn.Module):
    """A pre-norm transformer block; heads are reshaped with -1 so that a tensor-parallel rank runs its own."""

    def __init__(self, width: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k, self.v, self.out = (nn.Linear(width, width) for _ in range(4))
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (m(h).view(b, t, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, -1)
        x = x + self.out(a)
        return x + self.mlp(self.ln2(x))


class Transformer(nn.Sequential):
    tp_plan = megatron_plan  # the one line: q/k/v column-parallel, out row-parallel, the MLP's pair likewise

    def __init__(self, width: int = 32, head_dim: int = 8):
        super().__init__(Rows(), nn.Linear(8, width), Block(width, head_dim), Pool(), nn.Linear(width, 10))


def transformer(width: int = 32, head_dim: int = 8) -> Transformer:
    return Transformer(width, head_dim)


def flat() -> nn.Module:
    """Neither an nn.Sequential nor pipeline_parts(): it cannot be cut into stages."""
    return nn.Linear(64, 10)


def hf_llama(layers: int = 2, vocab: int = 160, seed: int = 0, tied: bool = False):
    """A transformers LlamaForCausalLM (as a user hands one over): its forward returns a ModelOutput, its FSDP units
    are its _no_split_modules (LlamaDecoderLayer)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)
