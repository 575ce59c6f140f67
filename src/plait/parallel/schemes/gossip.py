"""Gossip (plait.parallel.gossip): replicas average with their neighbours instead of all-reducing."""

from __future__ import annotations

from plait.errors import ConfigError
from plait.parallel.keys import GossipKeys
from plait.parallel.layout import Layout
from plait.parallel.scheme import Scheme, require_plain_data_parallel


def check(layout: Layout, keys: GossipKeys) -> None:
    if layout.sync != "gossip":
        return
    require_plain_data_parallel(layout)
    if layout.dp < 2:
        raise ConfigError(f"parallel.sync = 'gossip' needs neighbours to average with: parallel.dp = {layout.dp}; "
                          "set parallel.dp >= 2")


SCHEME = Scheme("gossip", applies=lambda layout, keys: layout.sync == "gossip", keys=GossipKeys, check=check,
                strategy="plait.parallel.gossip:build")
