"""A rank's model and the Strategy that owns its step, from the ordered list of schemes (plait.parallel.schemes).

    model, record = build_module(layout, cfg, reads_whole_model, make, device)   # on the meta device when sharded
    strategy = build_strategy(b)                                                  # b: a plait.parallel.scheme.Build
    summary = serve_rank(b)                                                       # a parameter server's rank serves

The worker's side of the schemes: each hook a scheme names is imported here, on its first call (plait.refs).
"""

from __future__ import annotations

from plait.models.meta import build_on_meta
from plait.parallel.keys import ShardInitKeys
from plait.parallel.layout import Layout
from plait.parallel.scheme import Build
from plait.parallel.schemes import SCHEMES, fsdp, step_owner
from plait.refs import resolve


def build_module(layout: Layout, cfg, reads_whole_model: bool, make, device, log=print, reseed=lambda: None):
    """The plain model for this layout: (model, None) built on the device, or (model, InitRecord) on the meta device
    when the layout shards it and parallel.shard_init is on (the scheme that cuts it materialises this rank's shards
    from the record). A model whose initialisation the record cannot replay is built whole, with a note."""
    if fsdp.shard_init(layout, cfg.keys(ShardInitKeys).shard_init, reads_whole_model):
        model, record = build_on_meta(make)
        if record.supported:
            return model, record
        log(f"note: parallel.shard_init: {record.unsupported}; every rank builds the whole model")
        reseed()  # the recording drew from the generator: start again from the seed
    return make().to(device), None


def serve_rank(b: Build) -> dict | None:
    """A rank whose role is to hold state for the others (a parameter server) serves here and returns its summary;
    None for a rank that trains."""
    if b.rt.role != "server":
        return None
    owner = step_owner(b.cfg, b.schemes or SCHEMES, b.layout)
    if owner.serve is None:
        raise ValueError(f"rank {b.rt.rank} is a server, but the step owner {owner.name!r} serves nothing")
    return resolve(owner.serve)(b, b.run_dir)


def build_strategy(b: Build):
    """Parallelize b.module as the layout says and build the optimizer and the Strategy that owns the step."""
    if not b.schemes:
        b.schemes = SCHEMES
    for scheme in b.schemes:
        if scheme.loss is not None and b.uses(scheme):
            b.loss_fn = resolve(scheme.loss)(b.loss_fn, b)
    build = step_owner(b.cfg, b.schemes, b.layout).strategy
    assert build is not None, "step_owner picks a scheme that builds a strategy"
    return resolve(build)(b)


__all__ = ["build_module", "build_strategy", "serve_rank"]
