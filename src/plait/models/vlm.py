"""A small vision-language model (model.name = "vlm"): an image encoder and plait's GPT, joined by a connector.

    model = build_vlm(cfg, spec)   # spec of data.name = "digit-captions" (plait.data.captions)
    logits = model(x)              # x: (batch, pixels + caption tokens) -> (batch, caption tokens, vocab)

The encoder is the CNN's convolution blocks with a 2 x 2 average pool: an 8 x 8 digit becomes 16 image tokens of
model.width features. model.connector chooses how they reach the language model (DLS ch. 13):

* "projection" (LLaVA, Liu et al. 2023): a two-layer MLP maps each image token into the LM's embedding space, and
  the 16 of them go before the caption's tokens;
* "cross_attention" (Flamingo, Alayrac et al. 2022): before each LM block a gated cross-attention layer lets the
  caption attend to the image tokens, x + tanh(a) attn(x, image), then x + tanh(b) ffn(x), with a = b = 0 at
  initialisation: the untrained model is the language model exactly;
* "qformer" (BLIP-2's Q-Former, Li et al. 2023): model.vlm_queries learned query tokens attend to each other and
  to the image tokens (one layer), and their outputs, projected, go before the caption's tokens.

The language model trains on the caption's next tokens (masked_lm_loss). finetune.freeze = ["lm.*"] keeps the
language model frozen (BLIP-2 and Flamingo's setting), ["lm.*", "encoder.*"] trains the connector alone.
zero_shot_accuracy reads a classifier off the language model: the digit word it finds likeliest after the
prompt "a handwritten" for each validation image, no classification head trained.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from plait.data.captions import CAPTION_TOKENS, CLASS_POSITION, DIGITS, IDS
from plait.data.spec import DataSpec
from plait.errors import ConfigError
from plait.models.gpt import GPT, MLP

CONNECTORS = ("projection", "cross_attention", "qformer")
POOL = 2


class Encoder(nn.Module):
    """Convolution blocks (as the CNN's), a POOL x POOL average pool, and a learned embedding of each token's place
    (as a ViT's; attention alone does not see where a token came from): images -> (batch, tokens, width)."""

    def __init__(self, image_shape: list, width: int, depth: int):
        super().__init__()
        chans = [image_shape[0]] + [width] * depth
        self.convs = nn.ModuleList(nn.Sequential(nn.Conv2d(a, b, 3, padding=1), nn.GroupNorm(1, b), nn.ReLU())
                                   for a, b in zip(chans[:-1], chans[1:]))
        self.pos = nn.Parameter(torch.randn((image_shape[1] // POOL) * (image_shape[2] // POOL), width) * 0.5)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images
        for conv in self.convs:
            x = conv(x)
        return F.avg_pool2d(x, POOL).flatten(2).transpose(1, 2) + self.pos


class CrossAttention(nn.Module):
    """Multi-head attention of x (batch, t, width) to memory (batch, m, kv_width), no mask."""

    def __init__(self, width: int, heads: int, kv_width: int):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(width, width), nn.Linear(kv_width, width), nn.Linear(kv_width, width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q = self.q(x).view(b, t, self.heads, -1).transpose(1, 2)
        k, v = (lin(memory).view(b, memory.shape[1], self.heads, -1).transpose(1, 2) for lin in (self.k, self.v))
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, w))


class Projection(nn.Module):
    """LLaVA: each image token through a two-layer MLP into the LM's embedding space."""

    def __init__(self, features: int, width: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(features, width), nn.GELU(), nn.Linear(width, width))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.mlp(image)


class QFormer(nn.Module):
    """BLIP-2: learned queries attend to the image, then to each other, then a feed-forward; projected. (One layer:
    self-attention first, as in BLIP-2's stack, would mix queries that are the same for every image.)"""

    def __init__(self, features: int, width: int, queries: int, heads: int):
        super().__init__()
        self.queries = nn.Parameter(torch.randn(queries, width) * 0.02)
        self.ln1, self.ln2, self.ln3 = nn.LayerNorm(width), nn.LayerNorm(width), nn.LayerNorm(width)
        self.self_attn = CrossAttention(width, heads, width)
        self.cross = CrossAttention(width, heads, features)
        self.ffn = MLP(width)
        self.out = nn.Linear(width, width)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        q = self.queries.expand(image.shape[0], -1, -1)
        q = self.cross(self.ln1(q), image)  # first, and no residual: the queries themselves are the same for every image
        h = self.ln2(q)
        q = q + self.self_attn(h, h)
        q = q + self.ffn(self.ln3(q))
        return self.out(q)


class GatedCrossAttention(nn.Module):
    """Flamingo: x + tanh(attn_gate) attn(ln(x), image), then + tanh(ffn_gate) ffn(ln(x)); both gates start at 0."""

    def __init__(self, width: int, heads: int, features: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CrossAttention(width, heads, features)
        self.ffn = MLP(width)
        self.attn_gate = nn.Parameter(torch.zeros(1))
        self.ffn_gate = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        x = x + torch.tanh(self.attn_gate) * self.attn(self.ln1(x), image)
        return x + torch.tanh(self.ffn_gate) * self.ffn(self.ln2(x))


class VLM(nn.Module):
    def __init__(self, lm: GPT, encoder: Encoder, connector: str, features: int, image_shape: list, heads: int,
                 queries: int = 8):
        super().__init__()
        self.lm, self.encoder, self.kind, self.image_shape = lm, encoder, connector, list(image_shape)
        width = lm.tok_emb.weight.shape[1]
        if connector == "projection":
            self.connector: nn.Module = Projection(features, width)
        elif connector == "qformer":
            self.connector = QFormer(features, width, queries, heads)
        else:
            self.connector = nn.ModuleDict({name: GatedCrossAttention(width, heads, features) for name in lm.blocks})

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A row of pixels then token ids -> (images, ids)."""
        pixels = math.prod(self.image_shape)
        return x[:, :pixels].reshape(-1, *self.image_shape), x[:, pixels:].round().long()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        images, ids = self.split(x)
        image = self.encoder(images)
        lm, t = self.lm, ids.shape[1]
        if self.kind == "cross_attention":
            h = lm.drop(lm.tok_emb(ids) + lm.pos_emb(torch.arange(t, device=ids.device)))
            for name, block in lm.blocks.items():
                h = block(self.connector[name](h, image))
        else:
            prefix = self.connector(image)
            p = prefix.shape[1]
            h = torch.cat([prefix, lm.tok_emb(ids)], 1)
            h = lm.drop(h + lm.pos_emb(torch.arange(p + t, device=ids.device)))
            for block in lm.blocks.values():
                h = block(h)
            h = h[:, p:]
        return lm.head(lm.ln_f(h))[..., :lm.vocab_size]


@torch.no_grad()
def zero_shot_accuracy(model: VLM, dataset, samples: int, batch: int = 64) -> float:
    """The share of the first `samples` samples whose digit word the LM finds likeliest after "<bos> a handwritten"
    (the logits at that position, over the ten digit words), against the word in the sample's caption."""
    words = torch.tensor([IDS[w] for w in DIGITS])
    was = model.training
    model.eval()
    right = total = 0
    for lo in range(0, min(samples, len(dataset)), batch):
        x, y = dataset.fetch(torch.arange(lo, min(lo + batch, samples, len(dataset))))
        scores = model(x)[:, CLASS_POSITION][:, words]
        right += int((words[scores.argmax(-1)] == y[:, CLASS_POSITION]).sum())
        total += len(y)
    model.train(was)
    return right / max(total, 1)


def build_vlm(cfg, spec: DataSpec) -> VLM:
    if not spec.image_shape:
        raise ConfigError(f"model.name = 'vlm' reads images with their captions; data.name = {spec.name!r} has no "
                          "images: use data.name = 'digit-captions'")
    if cfg.connector not in CONNECTORS:
        raise ConfigError(f"model.connector = {cfg.connector!r}: choose one of {', '.join(CONNECTORS)}")
    if cfg.width % cfg.heads:
        raise ConfigError(f"model.width = {cfg.width} must be divisible by model.heads = {cfg.heads}")
    side = spec.image_shape[1] // POOL
    prefix = {"projection": side * side, "qformer": cfg.vlm_queries, "cross_attention": 0}[cfg.connector]
    # the LM's context: the image prefix and the caption (model.context is not used)
    lm = GPT(spec.vocab_size, prefix + CAPTION_TOKENS - 1, cfg.width, cfg.heads, cfg.layers, cfg.tie_embeddings,
             cfg.dropout, activation=cfg.activation, norm_eps=cfg.norm_eps)
    encoder = Encoder(spec.image_shape, cfg.width, cfg.depth)
    return VLM(lm, encoder, cfg.connector, cfg.width, spec.image_shape, cfg.heads, cfg.vlm_queries)
