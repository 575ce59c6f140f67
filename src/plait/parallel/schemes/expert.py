"""Expert parallel (plait.parallel.expert): mixture-of-experts layers spread over ep ranks of the dp axis."""

from __future__ import annotations

from plait import models
from plait.errors import ConfigError
from plait.parallel.layout import Layout
from plait.parallel.scheme import Scheme


def applies(layout: Layout, keys) -> bool:
    return layout.ep > 1


def check(layout: Layout, keys) -> None:
    if layout.ep == 1:
        return
    if layout.dp % layout.ep:
        raise ConfigError(
            f"parallel.ep = {layout.ep} must divide parallel.dp = {layout.dp}: expert-parallel groups are made of "
            f"data-parallel ranks; set parallel.ep to a divisor of {layout.dp} or change parallel.dp")
    if layout.zero == 1:
        raise ConfigError(
            f"parallel.zero = 1 with parallel.ep = {layout.ep}: ZeRO-1's flat buffers would take the experts in; use "
            "parallel.zero=2 or 3 (FSDP2 shards the dense part) or zero=0")
    if layout.sync != "allreduce":
        raise ConfigError(
            f"parallel.ep = {layout.ep} averages the experts over their replicas by all-reduce; parallel.sync = "
            f"{layout.sync!r} replaces the all-reduce: set parallel.sync='allreduce' or parallel.ep=1")


def check_model(layout: Layout, keys, model_cfg, model) -> None:
    """The model has mixture-of-experts layers whose expert counts ep divides."""
    experts = models.expert_counts(model_cfg)  # a factory's: built on the meta device
    if not experts:
        raise ConfigError(
            f"parallel.ep = {layout.ep} spreads mixture-of-experts layers over ranks, but the model has none; set "
            f"model.moe_experts (a multiple of {layout.ep}) or parallel.ep=1")
    for e in sorted(set(experts)):
        if e % layout.ep:
            raise ConfigError(
                f"parallel.ep = {layout.ep} must divide model.moe_experts = {e}: each rank holds moe_experts / ep "
                f"experts; set model.moe_experts to a multiple of {layout.ep} or parallel.ep to a divisor of {e}")


def check_experts_tp(model_cfg, layout: Layout, sequence_parallel: bool) -> None:
    """Tensor parallel splits the dense matrices (attention, dense MLPs) and keeps each MoE block whole on every tp
    rank: its input is the whole activation (the attention's row-parallel output is all-reduced), so the tp ranks
    route the same tokens and compute the same expert gradients, as they do a LayerNorm's. Not with sequence
    parallel (an MoE block would take a shard of each sequence, and capacity is counted per whole sequence) nor
    with expert parallel."""
    experts = models.expert_counts(model_cfg)  # a factory's: built on the meta device
    if not experts:
        return
    if sequence_parallel:
        raise ConfigError(f"model.moe_experts ({experts[0]}) with parallel.sequence_parallel = true: an MoE block "
                          "routes whole sequences (capacity is counted per sequence) and sequence parallel hands it a "
                          "shard of each; set parallel.sequence_parallel=false")
    if layout.ep > 1:
        raise ConfigError(f"model.moe_experts ({experts[0]}) with parallel.ep = {layout.ep} and parallel.tp = "
                          f"{layout.tp}: with tp the experts stay whole on every tp rank; set parallel.ep=1 or "
                          "parallel.tp=1")


SCHEME = Scheme("expert", applies=applies, check=check, check_model=check_model, transform="plait.parallel.expert:transform",
                strategy="plait.parallel.expert:build")
