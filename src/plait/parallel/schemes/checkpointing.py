"""Activation checkpointing (plait.parallel.checkpointing, `train.activation_checkpointing`)."""

from __future__ import annotations

from plait.parallel.scheme import Scheme

SCHEME = Scheme("activation_checkpointing", applies=lambda layout, keys: layout.activation_checkpointing,
                transform="plait.parallel.checkpointing:transform")
