"""Sharded embedding tables (plait.parallel.embedding): DeepFM's tables over the dp ranks."""

from __future__ import annotations

from plait.errors import ConfigError
from plait.parallel.keys import EmbeddingKeys
from plait.parallel.layout import Layout
from plait.parallel.scheme import Scheme


def check(layout: Layout, keys: EmbeddingKeys) -> None:
    if keys.embedding_sharding == "none":
        return
    if layout.dp == 1 or layout.zero:
        raise ConfigError(f"parallel.embedding_sharding = {keys.embedding_sharding!r} shards over the dp ranks: it needs "
                          "parallel.dp >= 2 with zero = 0")


def check_model(layout: Layout, keys: EmbeddingKeys, model_cfg, model) -> None:
    if model_cfg.name != "deepfm" or model_cfg.factory:
        raise ConfigError(f"parallel.embedding_sharding = {keys.embedding_sharding!r} shards deepfm's embedding tables; "
                          f"model.name is {model_cfg.name!r}: set model.name='deepfm' or embedding_sharding='none'")


def applies(layout: Layout, keys: EmbeddingKeys) -> bool:
    return layout.embedding_sharding != "none" and layout.dp > 1


SCHEME = Scheme("embedding_sharding", applies=applies, keys=EmbeddingKeys, check=check, check_model=check_model,
                transform="plait.parallel.embedding:transform", strategy="plait.parallel.embedding:build")
