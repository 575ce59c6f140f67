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


def hf_pipeline_parts(model: nn.Module) -> dict | None:
    """plait's pipeline parts from the model's declared `_pp_plan`, or None when it declares none it can use.

    transformers' plan lists the base model's pieces in order with their inputs and outputs, e.g.
    LlamaForCausalLM's {"model.embed_tokens": (["input_ids"], ["inputs_embeds"]), "model.layers":
    (["hidden_states", "attention_mask"], ["hidden_states"]), "model.norm": ..., "lm_head": (..., ["logits"])}.
    The ModuleList is the blocks; the piece that takes input_ids only the first stage keeps, the others only
    the last. A later stage calls the model with the hidden states as `inputs_embeds` (what the embedding's
    entry says it makes), and an earlier one ends with the pieces after the blocks as identities, so the
    model's own forward (its rotary embedding, its causal mask) runs on every stage.
    """
    plan = dict(getattr(model, "_pp_plan", None) or {})
    lists = [n for n in plan if isinstance(model.get_submodule(n), nn.ModuleList)]
    first = [n for n, (inputs, _) in plan.items() if "input_ids" in inputs]  # the plan's order is not the model's
    if len(lists) != 1 or len(first) != 1 or list(plan[first[0]][1]) != ["inputs_embeds"]:
        return None
    return {"blocks": lists[0], "first": first, "last": [n for n in plan if n not in (*lists, *first)],
            "embeds_input": True}


def _embeds_input(module: nn.Module, args: tuple, kwargs: dict):
    """A later stage's input is the hidden states: the model takes them as inputs_embeds."""
    if args and args[0].is_floating_point():
        return (), {**kwargs, "inputs_embeds": args[0], "use_cache": False}
    return args, {**kwargs, "use_cache": False}


def as_hf_stage(part: nn.Module) -> nn.Module:
    part.register_forward_pre_hook(_embeds_input, with_kwargs=True)
    return part


def shared_parameters(model: nn.Module) -> dict[str, str]:
    """{alias: canonical} of parameters one tensor serves under two names (a tied embedding and head)."""
    first: dict[int, str] = {}
    tied = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
        else:
            first[id(p)] = name
    return tied
