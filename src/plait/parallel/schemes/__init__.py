"""The one ordered list of parallel schemes, each a declaration, and what is asked of it.

    layout = check_config(cfg)    # the layout's arithmetic and every scheme's own rules; ConfigError before launch
    strategy = build_strategy(b)  # b: a plait.parallel.scheme.Build; the Strategy that owns the step

Each scheme is two modules. Its declaration, here (plait.parallel.schemes.<name>): when it applies, its rules
against the layout and what it asks of the model, and the names of its hooks ("plait.parallel.fsdp:transform").
Its implementation, beside it (plait.parallel.<name>): the transform, the Strategy, what it does in a worker.
The job check, the launcher and the planner read the declarations only, so they never import DTensor, FSDP2,
pipelining or RPC; a worker imports an implementation when it calls one of its hooks.

SCHEMES fixes the order once (see plait.parallel.scheme): module transforms run in this order
(tensor parallel -> context parallel -> sharded embeddings -> a spread ensemble's member -> activation
checkpointing -> compile -> FSDP -> DDP), and the step belongs to the first scheme in it that applies and builds a
strategy (PipeDream, then the pipeline over RPC or collectives, then the parameter server and (asynchronous)
gossip, which replace the all-reduce, then sharded embeddings, expert parallel, a spread ensemble, ZeRO-1, FSDP,
DDP, and a single replica last). Offload wraps the optimizer of whichever owns the step. Adding a scheme is its
declaration, its implementation and one line here.
"""

from __future__ import annotations

import torch

from plait.models import load_factory
from plait.models.meta import build_on_meta
from plait.parallel.keys import ShardInitKeys
from plait.parallel.layout import Layout
from plait.parallel.scheme import Build, Scheme
from plait.parallel.schemes import (
    checkpointing,
    compiling,
    context,
    ddp,
    embedding,
    ensemble,
    expert,
    fsdp,
    gossip,
    gossip_async,
    hetero,
    offload,
    pipedream,
    pipeline,
    ps,
    rpc_pipeline,
    single,
    tp,
    zero,
)
from plait.refs import resolve

SCHEMES: list[Scheme] = [
    pipedream.SCHEME,
    rpc_pipeline.SCHEME,
    pipeline.SCHEME,
    ps.SCHEME,
    gossip_async.SCHEME,
    gossip.SCHEME,
    tp.SCHEME,
    context.SCHEME,
    embedding.SCHEME,
    expert.SCHEME,
    ensemble.SCHEME,
    zero.SCHEME,
    checkpointing.SCHEME,
    compiling.SCHEME,
    fsdp.SCHEME,
    ddp.SCHEME,
    hetero.SCHEME,
    offload.SCHEME,
    single.SCHEME,
]


def check_config(cfg, schemes: list[Scheme] | None = None, model=None, model_known: bool = True) -> Layout:
    """Check the layout against the config before any worker starts; returns the Layout.

    What the layout asks of the model (pipeline cut points, a TP plan) is checked on `model` when given, else on
    the model cfg names (a factory's is built on the meta device); model_known=False (`plait launch` of a user's
    script, whose model is built inside it) leaves that to plait.parallelize.
    """
    layout = Layout.from_config(cfg)
    layout.check_launch(cfg.max_nodes, cfg.launch.nnodes, cfg.launch.nproc_per_node)
    schemes = SCHEMES if schemes is None else schemes
    for scheme in schemes:
        scheme.check(layout, scheme.keys_of(cfg))
    asks = [(s, s.check_model) for s in schemes if s.check_model is not None and s.used(layout, cfg)]
    if asks and model_known:
        if model is None and cfg.model.factory:
            with torch.device("meta"):  # no memory, no initialisation cost
                model = load_factory(cfg.model.factory)(**cfg.model.options)
        for scheme, check_model in asks:
            check_model(layout, scheme.keys_of(cfg), cfg.model, model)
    return layout


def step_owner(cfg, schemes: list[Scheme] | None = None, layout: Layout | None = None) -> Scheme:
    """The first scheme in order that applies and builds a strategy."""
    layout = Layout.from_config(cfg) if layout is None else layout
    return next(s for s in (SCHEMES if schemes is None else schemes) if s.strategy is not None and s.used(layout, cfg))


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


__all__ = ["SCHEMES", "Build", "Layout", "Scheme", "build_module", "build_strategy", "check_config", "serve_rank",
           "step_owner"]
