"""ZeRO-2/3 with FSDP2 (plait.parallel.fsdp): the stages' rules, and when the model is built on the meta device."""

from __future__ import annotations

from plait.errors import ConfigError
from plait.parallel.layout import Layout
from plait.parallel.scheme import Scheme


def shard_init(layout: Layout, enabled: bool, reads_whole_model: bool) -> bool:
    """Whether the model is built on the meta device and each rank materialises only its own shards.

    ZeRO-2/3 (FSDP shards parameters at rest in both; after sharding), tensor parallelism (after its split;
    the shards of a 2-D (dp, tp) DTensor are cut the same way), pipeline stages (each stage its own).
    Expert/embedding layouts, and a run that changes or reads the plain model before it is cut (init_from a run
    directory, LoRA, distillation, the contrastive head: `reads_whole_model`), keep the whole-model build; a
    checkpoint file or Hugging Face directory is read in slices instead (plait.train.weights.checkpoint_parts).
    """
    return (enabled and (layout.shards_gradients or layout.splits_model) and layout.ep == 1
            and layout.embedding_sharding == "none" and layout.sync == "allreduce" and not reads_whole_model)


def check_zero(layout: Layout, stages: tuple[int, ...]) -> None:
    """What every ZeRO stage needs: data-parallel ranks to shard over (the optimizer's rule is the optimizer's)."""
    if layout.zero in stages and layout.replicas == 1:
        raise ConfigError(f"parallel.zero = {layout.zero} shards over the data-parallel axis, but parallel.dp = 1; "
                          "set parallel.dp >= 2 (or parallel.cp >= 2) or parallel.zero=0")


def check(layout: Layout, keys) -> None:
    if layout.offload == "params" and layout.zero < 2:
        raise ConfigError(
            f"parallel.offload = 'params' moves FSDP's parameter, gradient and optimizer shards to CPU memory and needs "
            f"parallel.zero = 2 or 3 (it is {layout.zero}); set parallel.zero=3, or parallel.offload='optimizer' "
            "(optimizer state only) or 'disk'")
    check_zero(layout, (2, 3))


SCHEME = Scheme("fsdp", applies=lambda layout, keys: layout.shards_gradients, check=check,
                transform="plait.parallel.fsdp:transform", strategy="plait.parallel.fsdp:build")
