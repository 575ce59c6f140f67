"""One decoder for plait's language models: GPT (plait.models.gpt) and the Llama family (plait.models.llama).

The decoder owns what the families do alike: the forward (a paged serving step, a KV-cached step, left padding,
packed rows, and the training path, which calls each block with x alone), the head over the padded vocabulary,
the initial weights, pipeline_parts, tied_parameters, the Megatron tp_plan, tp_check's rule and generate. A family
brings its blocks (norms, attention with its `sdpa` seam, MLP or MoE), three pieces (`embed`: ids -> hidden states,
with learned positions or not; `block_positions`: what its blocks take of the positions; `tp_sizes`: what tensor
parallel must divide) and a Family, the table of its modules' names:

    class GPT(Decoder):
        family = Family(attn=("q", "k", "v", "proj"), mlp=("up", "down"), norms=("ln1", "ln2"), final_norm="ln_f",
                        first=("tok_emb", "pos_emb", "drop"), learned_positions=True, split_untied_embedding=False)

The names stay each family's own, so checkpoints, Hugging Face mappings, LoRA targets and the Megatron patterns read
as before. A new family (a LayerNorm decoder with rotary positions, say) is its block pieces and one Family
(tests/models/test_decoder.py builds one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn

from plait.data.spec import DataSpec
from plait.errors import ConfigError
from plait.models.moe import MoE, MoEHooks
from plait.models.sampling import sample


class KVCache:
    """One block's keys and values (batch, heads, time, head_dim) of the tokens seen so far, for incremental decoding."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached keys and values followed by these new ones, kept for the next step."""
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.k, self.v = k, v
        return k, v


def window_mask(pos_q: torch.Tensor, pos_k: torch.Tensor, window: int, visible: torch.Tensor | None = None):
    """(b, 1, tq, tk) boolean: causal by position, within `window` positions (0: unlimited), and `visible` keys."""
    rel = pos_q[:, :, None] - pos_k[:, None, :]
    mask = rel >= 0
    if window:
        mask &= rel < window
    if visible is not None:
        mask &= visible[:, None, :]
    # A query that sees nothing (left padding) sees itself, so softmax stays finite; its output is unused.
    diag = torch.zeros_like(mask)
    if pos_q.shape[1] <= pos_k.shape[1]:
        off = pos_k.shape[1] - pos_q.shape[1]
        idx = torch.arange(pos_q.shape[1], device=mask.device)
        diag[:, idx, idx + off] = True
    mask |= diag & ~mask.any(-1, keepdim=True)
    return mask[:, None]


def attention_mask(pad: torch.Tensor, past: int, t: int, window: int = 0) -> torch.Tensor:
    """(batch, 1, t, past + t) boolean: query j of row i may see key c if pad_i <= c <= past + j (and c is within
    `window` positions, 0: unlimited); a padding query sees itself only."""
    keys = torch.arange(past + t, device=pad.device)[None] - pad[:, None]  # each row's positions from its first token
    return window_mask(keys[:, past:], keys, window, keys >= 0)


def packed_mask(pos: torch.Tensor, window: int = 0) -> torch.Tensor:
    """(batch, 1, t, t) boolean for packed rows (data.pack): causal within each example, a new one starting wherever
    its position is 0, and within `window` positions (0: unlimited). Padding after the last example is one-token
    examples (position 0), each seeing itself only."""
    doc = (pos == 0).cumsum(1)
    i = torch.arange(pos.shape[1], device=pos.device)
    mask = (i[:, None] >= i[None, :])[None] & (doc[:, :, None] == doc[:, None, :])
    if window:
        mask &= (pos[:, :, None] - pos[:, None, :]) < window
    return mask[:, None]


def padded(vocab: int, multiple: int) -> int:
    """The vocabulary's rows rounded up to a multiple (so that every tp degree dividing it splits them evenly)."""
    return -(-vocab // max(1, multiple)) * max(1, multiple)


def model_vocab(cfg, spec: DataSpec) -> int:
    """model.vocab_size, or the data's; ConfigError when it is smaller than the data's."""
    vocab = cfg.vocab_size or spec.vocab_size
    if spec.vocab_size and vocab < spec.vocab_size:
        raise ConfigError(f"model.vocab_size = {cfg.vocab_size} is smaller than the data's vocabulary ({spec.vocab_size}); "
                          "set model.vocab_size=0 to take the data's size")
    return vocab


def sequence_free(mlp: nn.Module) -> bool:
    """A block's MLP that tensor parallel leaves whole on every rank (an MoE: expert parallel spreads it)."""
    return isinstance(mlp, MoE)


@dataclass(frozen=True)
class Family:
    """A decoder family's table: the names of its modules, and what its kind of positions asks of the decoder."""

    attn: tuple[str, ...]  # each block's attention projections (under .attn): column-parallel ones, then the output
    mlp: tuple[str, ...]  # each dense block's feed-forward Linears (under .mlp): column-parallel ones, then the output
    norms: tuple[str, str]  # each block's norms: before the attention, before the MLP
    final_norm: str  # the norm before the head
    first: tuple[str, ...]  # the modules only the first pipeline stage holds (the embeddings)
    learned_positions: bool = False  # positions end at the context: a longer sequence is refused, generate recomputes
    split_untied_embedding: bool = True  # tensor parallel splits the token embedding over the vocabulary, tied or not


class Decoder(MoEHooks, nn.Module):
    """Token embedding, blocks, a final norm and a linear head over the padded vocabulary (tied to the embedding or not).

    A family's __init__ sets context, vocab_size, tie_embeddings (and sliding_window, when it has one), tok_emb and
    blocks, then calls `_finish`. A pipeline stage holds None for the modules it does not own (plait.parallel.split).
    """

    family: ClassVar[Family]
    sliding_window = 0  # every block's attention window (0: unlimited); the masks built here need it

    def _finish(self, norm: nn.Module, layers: int) -> None:
        """The final norm (under the family's name), the head over the embedding's rows, tied to it or not, and the
        initial weights: N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers) (GPT-2), biases 0, norms 1."""
        setattr(self, self.family.final_norm, norm)
        rows, width = self.tok_emb.weight.shape
        self.head = nn.Linear(width, rows, bias=False)
        if self.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        residual = (f"{self.family.attn[-1]}.weight", f"{self.family.mlp[-1]}.weight", "mlp.w2")
        for name, p in self.named_parameters():
            if name.endswith(("bias", "mlp.b1", "mlp.b2")):  # an MoE block's expert biases are stacked, (E, n)
                nn.init.zeros_(p)
            elif p.dim() == 1:
                nn.init.ones_(p)
            elif name.endswith(residual):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))
            else:
                nn.init.normal_(p, std=0.02)

    # ---- the family's pieces

    def embed(self, idx: torch.Tensor, pos: torch.Tensor | None) -> torch.Tensor:
        """Ids (batch, time) at positions `pos` (None: 0..time-1) -> the first block's input."""
        raise NotImplementedError

    def block_positions(self, pos: torch.Tensor | None, x: torch.Tensor, step: bool = False) -> dict:
        """The keywords each block takes for positions `pos` (None: the default ones); `step`: a paged serving step."""
        raise NotImplementedError

    def tp_sizes(self, tp: int) -> list[tuple[str, int, str]]:
        """(what, size, the fix) of each size tensor parallel must divide; `what` names the key and its value."""
        raise NotImplementedError

    # ---- the forward

    def forward(self, idx: torch.Tensor, cache: dict[str, KVCache] | None = None,
                pad: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (batch, time) -> logits (batch, time, vocab_size).

        A pipeline stage without the embeddings takes hidden states instead of ids, and one without the head returns
        hidden states (see plait.parallel.split). Packed rows (batch, 2, time) are ids, then each example's positions.
        Incremental decoding passes `cache` ({} at first, then the same dict: one KVCache per block, filled here), and
        idx holds only the tokens after the cached ones. `pad` (batch,) is each row's left padding: its positions
        start at 0 at its first real token and the padding is masked. A `cache` that is a paged step
        (plait.serve.engine.paged.PagedStep) gives the positions of idx (1, T), the tokens of many sequences, and
        attends each to its own cached keys.
        """
        return self.decode(idx, cache, pad)

    def decode(self, idx: torch.Tensor, cache: dict[str, KVCache] | None = None, pad: torch.Tensor | None = None,
               pos: torch.Tensor | None = None) -> torch.Tensor:
        """The forward of every family; `pos` (batch, time): the positions of idx, where the caller gives them."""
        if cache is not None and not isinstance(cache, dict):  # a paged serving step: its own positions and caches
            return self._step(idx, cache)
        idx, pos, mask = self._inputs(idx, cache, pad, pos)
        x = self.embed(idx, pos) if self.tok_emb is not None else idx  # a later pipeline stage takes hidden states
        extra = self.block_positions(pos, x)
        for name, block in self.blocks.items():
            if mask is None and not extra:  # training calls block(x) alone, as wrappers and tensor-parallel hooks expect
                x = block(x)
            else:
                x = block(x, cache=None if cache is None else cache.setdefault(name, KVCache()), mask=mask, **extra)
        return self._logits(x)

    def _inputs(self, idx: torch.Tensor, cache: dict | None, pad: torch.Tensor | None, pos: torch.Tensor | None):
        """(ids, positions or None for 0..t-1, mask or None for plain causal attention) of a forward's input."""
        packed = self.tok_emb is not None and idx.dim() == 3  # packed rows (data.pack): ids, then the positions
        if packed:
            idx, pos = idx[:, 0], idx[:, 1]
        t = idx.shape[1]
        past = len(next(iter(cache.values()))) if cache else 0
        if self.family.learned_positions and past + t > self.context:
            raise ValueError(f"sequence length {past + t} exceeds the model's context {self.context}")
        mask = None
        if cache is not None or pad is not None:
            pad = torch.zeros(idx.shape[0], dtype=torch.long, device=idx.device) if pad is None else pad.to(idx.device)
            if pos is None:  # each row's positions start at its first real token
                pos = (past + torch.arange(t, device=idx.device)[None, :] - pad[:, None]).clamp(min=0)
            mask = attention_mask(pad, past, t, self.sliding_window)
        if packed:  # each example sees its own tokens only
            mask = packed_mask(pos, self.sliding_window)
        return idx, pos, mask

    def _step(self, idx: torch.Tensor, step) -> torch.Tensor:
        """A paged serving step: every block attends through its own cache (`step.layer`); a stage before the last
        returns every token's hidden state, the last only the logits of `step.rows` (those the engine reads)."""
        x = self.embed(idx, step.positions) if self.tok_emb is not None else idx
        extra = self.block_positions(step.positions, x, step=True)
        for name, block in self.blocks.items():
            x = block(x, cache=step.layer(name), **extra)
        if self.head is not None and step.rows is not None:
            x = x[:, step.rows]
        return self._logits(x)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and the head, the padded rows' logits left out; a stage without the head returns x."""
        if self.head is None:
            return x
        x = self.head(getattr(self, self.family.final_norm)(x))
        return x[..., :self.vocab_size] if x.shape[-1] != self.vocab_size else x

    # ---- what the layouts ask of a model (plait.models.protocols)

    def pipeline_parts(self) -> dict:
        """How to cut the model into pipeline stages: the repeated blocks, and what goes before and after them."""
        return {"blocks": "blocks", "first": list(self.family.first), "last": [self.family.final_norm, "head"]}

    def tied_parameters(self) -> dict[str, str]:
        """Parameter names that alias another one: {alias: canonical}. A pipeline keeps both copies in step."""
        return {"head.weight": "tok_emb.weight"} if self.tie_embeddings else {}

    def tp_plan(self, sequence_parallel: bool) -> dict:
        """Megatron-LM's split of each block for torch.distributed.tensor.parallel.parallelize_module.

        Column-parallel attention projections (each rank keeps whole heads, and whole kv-head groups) and MLP inputs,
        row-parallel attention output and MLP output (one all-reduce, or a reduce-scatter with sequence parallel,
        each); an MoE block stays whole on every tp rank (plait.parallel.expert). The head is column-parallel over
        the vocabulary, and so is the token embedding (a vocabulary-parallel embedding) when tied to it or when the
        family splits it anyway. With sequence parallel, the norms work on a shard of the sequence and the residual
        stream between blocks is that shard. Modules a pipeline stage does not hold are left out.
        """
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

        f, sp = self.family, sequence_parallel
        rows_out = Shard(1) if sp else Replicate()
        plan: dict = {}
        if self.tok_emb is not None and (self.tie_embeddings or f.split_untied_embedding):
            plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        for name, block in self.blocks.items():
            b = f"blocks.{name}"
            for part, names in (("attn", f.attn), ("mlp", () if sequence_free(block.mlp) else f.mlp)):
                plan.update({f"{b}.{part}.{n}": ColwiseParallel() for n in names[:-1]})
                if names:
                    plan[f"{b}.{part}.{names[-1]}"] = RowwiseParallel(output_layouts=rows_out)
            if sp:
                gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
                plan.update({f"{b}.{f.norms[0]}": SequenceParallel(), f"{b}.{f.norms[1]}": SequenceParallel(),
                             f"{b}.attn": gather, f"{b}.mlp": gather})
        if sp and self.tok_emb is not None and "0" in self.blocks:
            # The embeddings' output is whole; the first block takes this rank's piece of the sequence.
            plan["blocks.0"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                                  use_local_output=True)
        if self.head is not None:
            if sp:
                plan[f.final_norm] = SequenceParallel()
            plan["head"] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Replicate())
        return plan

    def tp_check(self, tp: int) -> None:
        """Raise a ConfigError naming the key to change when a size (the family's tp_sizes) does not split over tp."""
        for what, size, fix in self.tp_sizes(tp):
            if size % tp:
                raise ConfigError(f"{what} is not divisible by parallel.tp = {tp}; {fix}")

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample `new_tokens` continuations of idx (batch, time), one token at a time: with the KV cache, or, where
        positions are learned (they end at the context), the last `context` tokens recomputed at each step."""
        if self.family.learned_positions:
            for _ in range(new_tokens):
                logits = self(idx[:, -self.context:])[:, -1, :]
                idx = torch.cat([idx, sample(logits, temperature, top_k, generator)], dim=1)
            return idx
        cache: dict[str, KVCache] = {}
        logits = self(idx, cache=cache)[:, -1, :]
        for _ in range(new_tokens):
            nxt = sample(logits, temperature, top_k, generator)
            idx = torch.cat([idx, nxt], dim=1)
            logits = self(nxt, cache=cache)[:, -1, :]
        return idx
