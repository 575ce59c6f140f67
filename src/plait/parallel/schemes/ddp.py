"""Data parallel with DDP (plait.parallel.ddp): whole replicas, and where the gradient compressions apply."""

from __future__ import annotations

from plait.errors import ConfigError
from plait.parallel.keys import DDPKeys
from plait.parallel.layout import Layout
from plait.parallel.scheme import Scheme

HALF = ("fp16", "bf16")  # casts the by-hand average over dp does itself (plait.parallel.ddp.HALF: their dtypes)
# compressions that run where no DDP bucket carries the gradient: plait.comm.compression.BY_HAND's names (it imports
# torch's comm hooks; tests/test_shape.py holds the two equal)
BY_HAND = ("topk", "int8", "powersgd")


def applies(layout: Layout, keys: DDPKeys) -> bool:
    """Whole replicas (tensor parallel ones included) averaged by DDP's all-reduce or by hand."""
    return (layout.replicas > 1 and layout.zero == 0 and layout.sync == "allreduce" and layout.embedding_sharding == "none"
            and layout.pp == 1)


def check(layout: Layout, keys: DDPKeys) -> None:
    if keys.allreduce != "native":
        if not (layout.plain_data_parallel and layout.replicas >= 2):
            raise ConfigError(
                f"parallel.allreduce = {keys.allreduce!r} runs DDP's gradient all-reduce as a comm hook: it needs "
                f"parallel.sync = 'allreduce' and dp >= 2 with tp = pp = ep = 1, zero = 0 and no embedding_sharding "
                f"(here {layout.describe()}); set parallel.allreduce='native' or change the layout")
        if keys.compression != "none":
            raise ConfigError(
                f"parallel.allreduce = {keys.allreduce!r} and parallel.compression = {keys.compression!r} are both DDP "
                "comm hooks and a model takes one; set parallel.allreduce='native' (compression makes its own "
                "collectives) or parallel.compression='none'")
    if keys.compression == "none":
        return
    if layout.sync != "allreduce":
        raise ConfigError(
            f"parallel.compression = {keys.compression!r} compresses the data-parallel all-reduce, but parallel.sync = "
            f"{layout.sync!r} has none; set parallel.compression='none' or parallel.sync='allreduce'")
    if layout.replicas < 2:
        raise ConfigError(
            f"parallel.compression = {keys.compression!r} compresses the gradients' data-parallel reduction, and "
            f"parallel.dp = {layout.dp} has none (no replicas to average over); set parallel.compression='none' or "
            "parallel.dp >= 2")
    if keys.compression in ("fp16", "bf16") and layout.shards_gradients and layout.ep == 1 \
            and layout.embedding_sharding == "none":
        return  # ZeRO-2/3: FSDP2 reduce-scatters the gradients in that dtype (plait.parallel.fsdp)
    if keys.compression in BY_HAND and layout.shards_gradients and layout.tp == layout.ep == 1 \
            and layout.embedding_sharding == "none":
        return  # ZeRO-2/3 (pp, cp too): each FSDP2 unit's reduce-scatter compressed (plait.parallel.fsdp_compress)
    by_hand = (*HALF, *BY_HAND)
    if keys.compression in by_hand and applies(layout, keys) and layout.tp > 1 and layout.ep == 1:
        return  # tp x dp: the by-hand average over dp casts, or runs the scheme on the flat shards (after_backward)
    if keys.compression in by_hand and layout.zero == 1 and layout.data_parallel_only and layout.ep == 1:
        return  # ZeRO-1: its flat reduce-scatter in that dtype, or the scheme on the flat buffer (plait.parallel.zero)
    if applies(layout, keys) and layout.ep > 1 and layout.tp == 1:
        return  # ep: DDP's hook compresses the dense part, any scheme (the experts' replicas average by hand, uncompressed)
    if not (layout.plain_data_parallel and layout.replicas >= 2):
        where = ("on DDP's buckets, ZeRO's reduce-scatter or tensor-parallel shards averaged over dp: it needs "
                 "parallel.dp >= 2 and plain DDP, ZeRO-1, tp x dp with zero = 0, or zero = 2 or 3 with tp = ep = 1 "
                 "(pp, cp too)" if keys.compression in BY_HAND else
                 "as a DDP communication hook: it needs parallel.dp >= 2 with tp = pp = ep = 1, zero = 0")
        raise ConfigError(
            f"parallel.compression = {keys.compression!r} runs {where} and no embedding_sharding (here "
            f"{layout.describe()}); set parallel.compression='none' or change the layout")


SCHEME = Scheme("ddp", applies=applies, keys=DDPKeys, check=check, transform="plait.parallel.ddp:transform",
                strategy="plait.parallel.ddp:build")
