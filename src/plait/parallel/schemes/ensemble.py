"""A spread ensemble (plait.parallel.ensemble): each member on its own ranks."""

from __future__ import annotations

from plait.parallel.layout import Layout
from plait.parallel.scheme import Scheme


def applies(layout: Layout, keys) -> bool:
    return layout.members > 1


SCHEME = Scheme("ensemble_spread", applies=applies, transform="plait.parallel.ensemble:keep_member",
                strategy="plait.parallel.ensemble:build")
