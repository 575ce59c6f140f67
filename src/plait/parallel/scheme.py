"""What a parallel scheme is: a small object in its own file, and what it is given to build with.

    SCHEME = Scheme(
        "zero1",
        applies=lambda cfg: cfg.parallel.dp > 1 and cfg.parallel.zero == 1,
        check=check,                 # raises ConfigError for this scheme's keys, before any worker starts
        strategy=build,              # Build -> Strategy: owns the step when it is the first that applies
    )

`plait.parallel.SCHEMES` orders every scheme once. That one order decides both things that
depend on order: module transforms (`transform`) run in list order on every scheme that applies
(tensor parallel before activation checkpointing before compile before FSDP/DDP, as torchtitan's
parallelize does), and the step belongs to the first applicable scheme that builds a strategy.
Adding a scheme is its file and one line in that list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from plait.errors import ConfigError


def _never(cfg) -> bool:
    return False


def _no_check(cfg) -> None:
    return None


@dataclass
class Build:
    """Everything a scheme needs to parallelize a model and build the step owner."""

    cfg: Any  # plait.config.Config
    rt: Any  # plait.runtime.Runtime
    layout: Any  # plait.parallel.layout.Layout
    module: nn.Module  # the plain model, on the device, initialised the same on every rank
    make_optimizer: Callable  # make_optimizer(module, only=None): the optimizer over module (or the ids in `only`)
    loss_fn: Callable
    precision: Any  # plait.parallel.base.Precision
    schemes: list = field(default_factory=list)  # plait.parallel.SCHEMES: the order of the transforms
    # plait.models.meta.InitRecord when `module` is on the meta device (ZeRO-3's shard-only initialisation):
    # the scheme that shards it materialises its shards from the record
    meta_init: Any = None

    @property
    def local_batch(self) -> int:
        """Samples per step on this data-parallel rank."""
        return self.layout.local_batch

    def materialize(self, model: nn.Module) -> dict | None:
        """Shard-only initialisation: fill `model`'s (sharded) meta parameters from meta_init; its figures.

        The scheme that cuts the parameters calls it once they are cut (FSDP after sharding, tensor
        parallel without FSDP after its split, the pipeline for each stage); a model already filled, or a
        run built the ordinary way, is left alone.
        """
        if self.meta_init is None or not any(p.is_meta for p in model.parameters()):
            return None
        from plait.models.meta import materialize

        init = materialize(model, self.meta_init, self.rt.device)
        mb = 1 / 2**20
        self.rt.print(f"shard-only init: {init['local_bytes'] * mb:.1f} MiB of parameters on this rank, at most "
                      f"{init['peak_bytes'] * mb:.1f} MiB while materialising (the whole model: "
                      f"{init['full_bytes'] * mb:.1f} MiB)")
        return init

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Apply the transform of every scheme that applies, in SCHEMES order, to a plain model (or pipeline stage)."""
        for scheme in self.schemes:
            if scheme.transform is not None and scheme.applies(self.cfg):
                model = scheme.transform(model, self)
        return model


@dataclass(frozen=True)
class Scheme:
    name: str
    applies: Callable[[Any], bool] = _never  # cfg -> whether the layout uses this scheme
    check: Callable[[Any], None] = _no_check  # cfg -> None, or raise ConfigError naming the key and the fix
    # (cfg, model) -> None, or ConfigError: what the layout asks of the model (model None: the registered one cfg names)
    check_model: Callable[[Any, nn.Module | None], None] | None = None
    transform: Callable[[nn.Module, Build], nn.Module] | None = None  # a module transform, in SCHEMES order
    strategy: Callable[[Build], Any] | None = None  # Build -> Strategy (the step owner)
    serve: Callable[[Build, Any], dict] | None = None  # (Build, run_dir) -> summary, for ranks whose role is "server"


def require_plain_data_parallel(cfg) -> None:
    """parallel.sync other than 'allreduce' replaces DDP on plain data parallelism, in fp32 or bf16."""
    p = cfg.parallel
    if p.sync == "allreduce":
        return
    if p.tp > 1 or p.pp > 1 or p.zero or p.embedding_sharding != "none":
        raise ConfigError(
            f"parallel.sync = {p.sync!r} replaces DDP's all-reduce and works on plain data parallelism: it needs "
            f"tp = pp = 1, zero = 0 and no embedding_sharding (here dp = {p.dp}, tp = {p.tp}, pp = {p.pp}, "
            f"zero = {p.zero}); set parallel.sync='allreduce' or change the layout")
    if cfg.precision.dtype == "fp16":
        raise ConfigError(f"parallel.sync = {p.sync!r} does not take fp16 loss scaling; set precision.dtype='bf16' or 'fp32'")
