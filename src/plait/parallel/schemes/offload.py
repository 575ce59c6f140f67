"""Optimizer offload (plait.parallel.offload): its state in host memory or on disk, chunk by chunk."""

from __future__ import annotations

from plait.errors import ConfigError
from plait.parallel.layout import Layout
from plait.parallel.scheme import Scheme


def check(layout: Layout, keys) -> None:
    """parallel.offload = "disk" / "optimizer": the layouts they compose with (the optimizer's rule is the optimizer's:
    layout.elementwise_optimizer_only)."""
    if layout.offload not in ("disk", "optimizer"):
        return
    if layout.offload == "optimizer" and (layout.shards_gradients or not layout.data_parallel_only):
        raise ConfigError(
            f"parallel.offload = 'optimizer' works with data parallelism (zero = 0) and ZeRO-1 (zero = 1), where "
            f"parameters are plain tensors; this layout has zero = {layout.zero}, tp = {layout.tp}, pp = {layout.pp}, "
            f"sync = {layout.sync!r}, ep = {layout.ep}, embedding_sharding = {layout.embedding_sharding!r}: "
            + ("use parallel.offload='params' (FSDP2's CPU offload) with zero 2/3, or parallel.offload='disk'"
               if layout.zero >= 2 else "set parallel.offload='disk' (any all-reduce layout) or 'none'"))
    if layout.sync != "allreduce" or layout.embedding_sharding != "none":
        raise ConfigError(
            f"parallel.offload = {layout.offload!r} wraps the optimizer of an all-reduce layout; this one has sync = "
            f"{layout.sync!r}, embedding_sharding = {layout.embedding_sharding!r}: set parallel.offload='none'")


SCHEME = Scheme("offload", applies=lambda layout, keys: layout.offload in ("disk", "optimizer"), check=check,
                wrap_optimizer="plait.parallel.offload:wrap")
