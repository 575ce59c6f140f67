"""ZeRO-1 (plait.parallel.zero): the optimizer's state sharded over the dp ranks, whole tensors each."""

from __future__ import annotations

from plait.errors import ConfigError
from plait.parallel.layout import Layout
from plait.parallel.scheme import Scheme
from plait.parallel.schemes.fsdp import check_zero


def check(layout: Layout, keys) -> None:
    check_zero(layout, (1,))
    if layout.zero == 1 and layout.tp > 1:
        raise ConfigError(
            f"parallel.zero = 1 does not combine with tensor parallelism (tp = {layout.tp}); use parallel.zero=2 or 3 "
            "with tp, or zero=0")


SCHEME = Scheme("zero1", applies=lambda layout, keys: layout.shards_optimizer and layout.zero == 1, check=check,
                strategy="plait.parallel.zero:build")
