"""Context parallel (plait.parallel.context): the layouts and the models whose sequences a cp group can split."""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.errors import ConfigError
from plait.parallel.keys import ContextParallelKeys
from plait.parallel.layout import Layout
from plait.parallel.scheme import Scheme

if TYPE_CHECKING:
    import torch.nn as nn


def check(layout: Layout, keys: ContextParallelKeys) -> None:
    if layout.cp == 1:
        return
    what = f"parallel.cp = {layout.cp}"
    if layout.ep > 1:
        raise ConfigError(f"{what} with parallel.ep = {layout.ep} is not available yet: both cut the dp axis; set "
                          "parallel.ep=1 or parallel.cp=1")
    if layout.sync != "allreduce":
        raise ConfigError(f"{what} needs parallel.sync = 'allreduce': a cp group's ranks hold pieces of the same "
                          f"sequences and must average every step (here {layout.sync!r})")
    if layout.embedding_sharding != "none":
        raise ConfigError(f"{what} splits sequences; parallel.embedding_sharding is for DeepFM's tables: set "
                          "parallel.cp=1")


def check_model(layout: Layout, keys: ContextParallelKeys, m, model: nn.Module | None) -> None:
    """A causal language model with an attention seam, no dropout, and sequences that cut into 2 cp chunks."""
    cp = layout.cp
    if model is not None and not attention_modules(model):
        raise ConfigError(f"parallel.cp = {cp} replaces each attention's `sdpa` with ring attention, but "
                          f"{m.factory or type(model).__name__} has none (plait's gpt and llama do); set parallel.cp=1")
    if model is None and m.name not in ("gpt", "llama"):
        raise ConfigError(f"parallel.cp = {cp} splits the sequences of a language model (model.name = 'gpt' or "
                          f"'llama'), not model.name = {m.name!r}; set parallel.cp=1")
    if getattr(m, "dropout", 0.0):
        raise ConfigError(f"parallel.cp = {cp}: ring attention has no attention dropout; set model.dropout=0")
    if getattr(m, "moe_experts", 0) and getattr(m, "moe_capacity_factor", 0.0):
        raise ConfigError(f"parallel.cp = {cp} with model.moe_capacity_factor = {m.moe_capacity_factor}: an expert's "
                          "capacity is counted per sequence, which cp cuts between ranks; set moe_capacity_factor=0 "
                          "(dropless) or parallel.cp=1")
    if (m.rope_scaling or {}).get("rope_type") == "dynamic":
        raise ConfigError(f"parallel.cp = {cp}: dynamic rope scaling depends on the longest position a rank sees; "
                          "use another model.rope_scaling or parallel.cp=1")
    if m.context % (2 * cp):
        raise ConfigError(f"model.context ({m.context}) must be divisible by 2 x parallel.cp = {2 * cp}: the zig-zag "
                          f"layout cuts each sequence into {2 * cp} equal chunks; set model.context to a multiple of "
                          f"{2 * cp}")


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose attention context parallel replaces: those with an `sdpa` (plait's GPT and Llama)."""
    return [m for m in model.modules() if callable(getattr(m, "sdpa", None))]


SCHEME = Scheme("context_parallel", applies=lambda layout, keys: layout.cp > 1, keys=ContextParallelKeys, check=check,
                check_model=check_model, transform="plait.parallel.context:transform",
                batches="plait.parallel.context:batches", loss="plait.parallel.context:loss")
