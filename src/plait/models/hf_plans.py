"""A transformers model's own tensor-parallel plan, as torch's ParallelStyles.

    plan = hf_tp_plan(model)          # {module name: ParallelStyle}, or None when the model declares none
    hf_tp_check(model, tp)            # ConfigError naming what does not split over tp ranks

Every transformers architecture declares its Megatron split: the model class's `_tp_plan` (the base
model's `base_model_tp_plan` under its prefix, plus the head), e.g. LlamaForCausalLM's
{"model.layers.*.self_attn.q_proj": "colwise", ..., "model.layers.*.mlp.down_proj": "rowwise",
"model.embed_tokens": "embedding_rowwise", "lm_head": "colwise_gather_output"}. A `*` stands for one
name (a layer's index). The styles plait maps are those of a dense decoder or encoder: column- and
row-parallel Linears, a vocabulary-parallel embedding, and a column-parallel head whose logits are
gathered. Attention keeps whole heads on each rank (the modules reshape with -1 heads), so the query and
key/value head counts must divide over tp.
"""

from __future__ import annotations

import re

import torch.nn as nn

from plait.errors import ConfigError


def _style(kind: str):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"colwise": lambda: ColwiseParallel(), "rowwise": lambda: RowwiseParallel(),
            "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
            "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
            "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
            "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate())}.get(kind)


def declared_plan(model: nn.Module) -> dict[str, str]:
    """The model's `_tp_plan` ({pattern: style name}), {} when it declares none."""
    return dict(getattr(model, "_tp_plan", None) or {})


def _matches(pattern: str, names: list[str]) -> list[str]:
    regex = re.compile("^" + r"\.".join("[^.]+" if atom == "*" else re.escape(atom) for atom in pattern.split("."))
                       + "$")
    return [n for n in names if regex.match(n)]


def hf_tp_plan(model: nn.Module) -> dict | None:
    """{module name: ParallelStyle} from the model's declared plan, or None when it declares none."""
    declared = declared_plan(model)
    if not declared:
        return None
    names = [n for n, _ in model.named_modules() if n]
    plan = {}
    for pattern, kind in declared.items():
        make = _style(kind)
        if make is None:
            raise ConfigError(f"{type(model).__name__}'s tensor-parallel plan splits {pattern!r} as {kind!r}, which "
                              "plait does not map (it maps colwise, rowwise, colwise_gather_output, colwise_rep, "
                              "embedding_rowwise and rowwise_rep); set parallel.tp=1")
        for name in _matches(pattern, names):
            plan[name] = make()
    return plan


def hf_tp_check(model: nn.Module, tp: int) -> None:
    """Head counts and the vocabulary against tp (the Linear sizes are checked with every plan's)."""
    what = type(model).__name__
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    for key, n in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
        if n and n % tp:
            raise ConfigError(f"parallel.tp = {tp} splits {what}'s attention by heads, but its {key} = {n} is not "
                              f"divisible by {tp}; set parallel.tp to a divisor of {n}")
    plan = hf_tp_plan(model) or {}
    for name in plan:
        mod = model.get_submodule(name)
        if isinstance(mod, nn.Embedding) and mod.num_embeddings % tp:
            raise ConfigError(f"parallel.tp = {tp} splits {name} by rows (its vocabulary of {mod.num_embeddings}), "
                              f"which is not divisible by {tp}; pad the vocabulary to a multiple of {tp} "
                              "(resize_token_embeddings) or set parallel.tp=1")
