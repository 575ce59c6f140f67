"""Heterogeneous data parallel (plait.parallel.hetero): batch shares by each rank's speed."""

from __future__ import annotations

from plait.errors import ConfigError
from plait.parallel.keys import HeteroKeys
from plait.parallel.layout import Layout
from plait.parallel.scheme import Scheme


def parse(spec: str, dp: int) -> list[float] | None:
    """'' -> None (off); 'auto' -> [] (measure); '1,3' -> fixed relative speeds, one per dp rank."""
    if not spec:
        return None
    if spec == "auto":
        return []
    try:
        speeds = [float(s) for s in spec.split(",")]
    except ValueError:
        raise ConfigError(f"parallel.hetero = {spec!r}: give 'auto' or one relative speed per data-parallel rank, "
                          f"e.g. '1,3'") from None
    if len(speeds) != dp or any(s <= 0 for s in speeds):
        raise ConfigError(f"parallel.hetero = {spec!r}: give {dp} positive relative speeds (one per data-parallel "
                          f"rank, parallel.dp = {dp}), e.g. '{','.join(['1'] * dp)}'")
    return speeds


def check(layout: Layout, keys: HeteroKeys) -> None:
    """parallel.hetero: data parallel with all-reduce only."""
    if not keys.hetero:
        return
    parse(keys.hetero, layout.dp)
    if layout.dp < 2 or not layout.plain_data_parallel or layout.cp > 1:
        raise ConfigError(f"parallel.hetero = {keys.hetero!r} splits the batch of data-parallel ranks that all-reduce "
                          f"their gradients: it needs parallel.dp >= 2 with tp = pp = ep = cp = 1, zero = 0, "
                          f"sync = 'allreduce' (here dp = {layout.dp}, tp = {layout.tp}, pp = {layout.pp}, zero = "
                          f"{layout.zero}, sync = {layout.sync!r}); set parallel.hetero='' or change the layout")


SCHEME = Scheme("hetero", applies=lambda layout, keys: bool(keys.hetero), keys=HeteroKeys, check=check,
                callbacks="plait.parallel.hetero:callbacks")
