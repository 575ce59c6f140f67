"""Asynchronous gossip (plait.parallel.gossip_async): active and passive ranks in pairs."""

from __future__ import annotations

from plait.errors import ConfigError
from plait.parallel.keys import GossipKeys
from plait.parallel.layout import Layout
from plait.parallel.scheme import Scheme


def check(layout: Layout, keys: GossipKeys) -> None:
    if keys.gossip_async and layout.sync == "gossip" and layout.dp % 2:
        raise ConfigError(f"parallel.gossip_async pairs each active (even) rank with passive (odd) ones and needs an "
                          f"even parallel.dp: dp = {layout.dp}; set parallel.dp={layout.dp + 1}")


# Before synchronous gossip in the list: it owns the step when gossip is asynchronous.
SCHEME = Scheme("gossip_async", applies=lambda layout, keys: layout.sync == "gossip" and keys.gossip_async,
                keys=GossipKeys, check=check, strategy="plait.parallel.gossip_async:build")
