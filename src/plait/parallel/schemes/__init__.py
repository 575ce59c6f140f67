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

import importlib
from typing import Any

from plait import models
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
            import torch  # only a factory's model is built here: torch, on the meta device

            with torch.device("meta"):  # no memory, no initialisation cost
                model = models.load_factory(cfg.model.factory)(**cfg.model.options)
        for scheme, check_model in asks:
            check_model(layout, scheme.keys_of(cfg), cfg.model, model)
    return layout


def step_owner(cfg, schemes: list[Scheme] | None = None, layout: Layout | None = None) -> Scheme:
    """The first scheme in order that applies and builds a strategy."""
    layout = Layout.from_config(cfg) if layout is None else layout
    return next(s for s in (SCHEMES if schemes is None else schemes) if s.strategy is not None and s.used(layout, cfg))


def implementation_modules(cfg=None) -> list[str]:
    """The modules of the schemes the job `cfg` uses (every scheme's when None): what a fork server imports once
    before it forks the workers (or a test's ranks), instead of each of them importing its own copy."""
    layout = None if cfg is None else Layout.from_config(cfg)
    return sorted({m for s in SCHEMES if layout is None or s.used(layout, cfg) for m in s.modules()})


# What a worker asks of the list (plait.parallel.assemble: the rank's model and the Strategy that owns its step),
# imported on first use (PEP 562): the job check needs the declarations only.
_WORKER = ("build_module", "build_strategy", "serve_rank")


def __getattr__(name: str) -> Any:
    if name in _WORKER:
        return getattr(importlib.import_module("plait.parallel.assemble"), name)
    raise AttributeError(f"module 'plait.parallel.schemes' has no attribute {name!r}")


__all__ = ["SCHEMES", "Build", "Layout", "Scheme", "build_module", "build_strategy", "check_config",
           "implementation_modules", "serve_rank", "step_owner"]
