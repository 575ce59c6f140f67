"""Parallel layouts: one file per scheme, and the one ordered list of them.

    check_config(cfg)             # the layout's arithmetic and every scheme's own keys; ConfigError before launch
    strategy = build_strategy(b)  # b: a plait.parallel.scheme.Build; the Strategy that owns the step

SCHEMES fixes the order once (see plait.parallel.scheme): module transforms run in this order
(tensor parallel -> sharded embeddings -> activation checkpointing -> compile -> FSDP -> DDP), and
the step belongs to the first scheme in it that applies and builds a strategy (pipeline, then the
parameter server and gossip, which replace the all-reduce, then sharded embeddings, expert parallel,
ZeRO-1, FSDP, DDP, and a single replica last). Adding a scheme is its file and one line here.
"""

from __future__ import annotations

from plait.parallel import (
    checkpointing,
    compiling,
    ddp,
    embedding,
    expert,
    fsdp,
    gossip,
    pipeline,
    ps,
    single,
    tp,
    zero,
)
from plait.parallel.base import Precision, Strategy
from plait.parallel.layout import Layout
from plait.parallel.scheme import Build, Scheme

SCHEMES: list[Scheme] = [
    pipeline.SCHEME,
    ps.SCHEME,
    gossip.SCHEME,
    tp.SCHEME,
    embedding.SCHEME,
    expert.SCHEME,
    zero.SCHEME,
    checkpointing.SCHEME,
    compiling.SCHEME,
    fsdp.SCHEME,
    ddp.SCHEME,
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
        scheme.check(cfg)
    asks = [s for s in schemes if s.check_model is not None and s.applies(cfg)]
    if asks and model_known:
        if model is None and cfg.model.factory:
            import torch

            from plait.models import load_factory

            with torch.device("meta"):  # no memory, no initialisation cost
                model = load_factory(cfg.model.factory)(**cfg.model.options)
        for scheme in asks:
            scheme.check_model(cfg, model)
    return layout


def step_owner(cfg, schemes: list[Scheme] | None = None) -> Scheme:
    """The first scheme in order that applies and builds a strategy."""
    return next(s for s in (SCHEMES if schemes is None else schemes) if s.strategy is not None and s.applies(cfg))


def build_strategy(b: Build) -> Strategy:
    """Parallelize b.module as the layout says and build the optimizer and the Strategy that owns the step."""
    if not b.schemes:
        b.schemes = SCHEMES
    return step_owner(b.cfg, b.schemes).strategy(b)


__all__ = ["SCHEMES", "Build", "Layout", "Precision", "Scheme", "Strategy", "build_strategy", "check_config", "step_owner"]
