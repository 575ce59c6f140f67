"""What a parallel scheme is: a small declaration that names its implementation, and what it is given to build with.

    SCHEME = Scheme(                 # plait/parallel/schemes/zero.py
        "zero1",
        applies=lambda layout, keys: layout.shards_optimizer and layout.zero == 1,
        keys=None,                   # or its key group (plait.parallel.keys): check and applies get cfg.keys(it)
        check=check,                 # (layout, keys) -> None, or ConfigError naming the key, before any worker starts
        strategy="plait.parallel.zero:build",  # Build -> Strategy: owns the step when it is the first that applies
    )

The declaration's own fields (applies, keys, check, check_model) are what the job check asks before any
worker starts. The hooks a worker calls (transform, strategy, serve, ...) are named "package.module:function"
and imported when first called (plait.refs), so that reading the declarations imports none of the
implementations (DTensor, FSDP2, pipelining, RPC); a hook may also be the function itself (a test's toy scheme).

`plait.parallel.schemes.SCHEMES` orders every scheme once. That one order decides both things that
depend on order: module transforms (`transform`) run in list order on every scheme that applies
(tensor parallel before activation checkpointing before compile before FSDP/DDP, as torchtitan's
parallelize does), and the step belongs to the first applicable scheme that builds a strategy.
Adding a scheme is its declaration (plait/parallel/schemes/<name>.py), its implementation (plait/parallel/<name>.py),
its keys (if it has any) and one line in that list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from plait.errors import ConfigError
from plait.parallel.layout import Layout
from plait.refs import Ref, resolve

if TYPE_CHECKING:
    import torch.nn as nn


def _never(layout: Layout, keys: Any) -> bool:
    return False


def _no_check(layout: Layout, keys: Any) -> None:
    return None


@dataclass(frozen=True)
class Scheme:
    name: str
    applies: Callable[[Layout, Any], bool] = _never  # (layout, its keys) -> whether the job uses this scheme
    keys: type | None = None  # its key group (plait.parallel.keys), given to applies and check
    check: Callable[[Layout, Any], None] = _no_check  # (layout, keys) -> None, or raise ConfigError naming the fix
    # (layout, keys, model cfg, model) -> None, or ConfigError: what the layout asks of the model (model None: the
    # registered one the model cfg names)
    check_model: Callable[[Layout, Any, Any, nn.Module | None], None] | None = None
    # The hooks, each a "package.module:function" (plait.refs) or the function:
    transform: Ref | None = None  # (nn.Module, Build) -> nn.Module: a module transform, in SCHEMES order
    strategy: Ref | None = None  # Build -> Strategy (the step owner)
    serve: Ref | None = None  # (Build, run_dir) -> summary, for ranks whose role is "server"
    # (optimizer, Build) -> the optimizer the step uses (offload moves its state out of device memory)
    wrap_optimizer: Ref | None = None
    # (Build, strategy) -> callbacks for the training loop (plait.train.callbacks.Callback's members), e.g. hetero's shares
    callbacks: Ref | None = None
    # Build -> a function of each micro-batch (inputs, targets) before the step sees it (context parallel keeps this
    # rank's tokens); the global batch itself is the sampler's, whatever the schemes
    batches: Ref | None = None
    # (loss, Build) -> the loss the step uses, for a scheme whose cut batches need their own (context parallel's
    # masked targets)
    loss: Ref | None = None

    def keys_of(self, cfg) -> Any:
        """This scheme's view of its keys in cfg (None when it declares none)."""
        return cfg.keys(self.keys) if self.keys is not None else None

    def used(self, layout: Layout, cfg) -> bool:
        """Whether the job `cfg` with this `layout` uses the scheme."""
        return self.applies(layout, self.keys_of(cfg))

    def modules(self) -> set[str]:
        """The modules its hooks name (its implementation), unimported: what a warm fork server imports once."""
        hooks = (self.transform, self.strategy, self.serve, self.wrap_optimizer, self.callbacks, self.batches, self.loss)
        return {ref.partition(":")[0] for ref in hooks if isinstance(ref, str)}


@dataclass
class Build:
    """Everything a scheme needs to parallelize a model and build the step owner."""

    cfg: Any  # plait.config.Config
    rt: Any  # plait.runtime.Runtime
    layout: Layout
    module: nn.Module  # the plain model, on the device, initialised the same on every rank
    new_optimizer: Callable  # new_optimizer(module, only=None): the configured optimizer over module (or the ids in `only`)
    loss_fn: Callable
    precision: Any  # plait.parallel.base.Precision
    schemes: list = field(default_factory=list)  # plait.parallel.schemes.SCHEMES: the order of the transforms
    # plait.models.meta.InitRecord when `module` is on the meta device (ZeRO-3's shard-only initialisation):
    # the scheme that shards it materialises its shards from the record
    meta_init: Any = None
    run_dir: Any = None  # the run directory (None: a run that writes nothing), for schemes that keep files there

    @property
    def local_batch(self) -> int:
        """Samples per step on this data-parallel rank."""
        return self.layout.local_batch

    def keys(self, group: type) -> Any:
        """A key group's view of the job's config (a scheme's own, or another's it builds with)."""
        return self.cfg.keys(group)

    def uses(self, scheme: Scheme) -> bool:
        return scheme.used(self.layout, self.cfg)

    def make_optimizer(self, module: nn.Module, only: set[int] | None = None):
        """The optimizer over module (or the parameter ids in `only`), wrapped by every scheme that wraps one."""
        optimizer = self.new_optimizer(module, only)
        for scheme in self.schemes:
            if scheme.wrap_optimizer is not None and self.uses(scheme):
                optimizer = resolve(scheme.wrap_optimizer)(optimizer, self)
        return optimizer

    def batch_transform(self) -> Callable | None:
        """What every scheme that applies does to a micro-batch before the step, in SCHEMES order (None: nothing)."""
        fns = [resolve(s.batches)(self) for s in self.schemes if s.batches is not None and self.uses(s)]
        if not fns:
            return None

        def apply(batch):
            for fn in fns:
                batch = fn(batch)
            return batch

        return apply

    def callbacks(self, strategy: Any) -> list:
        """The loop callbacks every scheme that applies brings, in SCHEMES order."""
        return [c for s in self.schemes if s.callbacks is not None and self.uses(s)
                for c in resolve(s.callbacks)(self, strategy)]

    def materialize(self, model: nn.Module) -> dict | None:
        """Shard-only initialisation: fill `model`'s (sharded) meta parameters from meta_init (a replayed
        initialisation, or train.init_from's checkpoint read in slices); its figures.

        The scheme that cuts the parameters calls it once they are cut (FSDP after sharding, tensor
        parallel without FSDP after its split, the pipeline for each stage); a model already filled, or a
        run built the ordinary way, is left alone.
        """
        if self.meta_init is None or not any(p.is_meta for p in model.parameters()):
            return None
        from plait.models.meta import materialize  # lazily: only shard-only initialisation needs it

        init = materialize(model, self.meta_init, self.rt.device)
        mb = 1 / 2**20
        rss = (f"; resident memory rose {(init['peak_rss_bytes'] - init['rss_before_bytes']) * mb:.1f} MiB while "
               "reading the checkpoint's slices" if "peak_rss_bytes" in init else "")
        self.rt.print(f"shard-only init: {init['local_bytes'] * mb:.1f} MiB of parameters on this rank, at most "
                      f"{init['peak_bytes'] * mb:.1f} MiB while materialising (the whole model: "
                      f"{init['full_bytes'] * mb:.1f} MiB){rss}")
        return init

    def parallelize(self, model: nn.Module, skip: tuple[str, ...] = ()) -> nn.Module:
        """Apply the transform of every scheme that applies, in SCHEMES order, to a plain model (or pipeline stage).

        skip: schemes whose transform the caller applies itself (expert parallel applies FSDP2 with its experts left out)."""
        for scheme in self.schemes:
            if scheme.transform is not None and scheme.name not in skip and self.uses(scheme):
                model = resolve(scheme.transform)(model, self)
        return model


def require_plain_data_parallel(layout: Layout) -> None:
    """parallel.sync other than 'allreduce' replaces DDP on whole replicas, in fp32 or bf16."""
    if layout.sync == "allreduce":
        return
    if not layout.replicas_without_a_mesh_axis:
        raise ConfigError(
            f"parallel.sync = {layout.sync!r} replaces DDP's all-reduce and works on plain data parallelism: it needs "
            f"tp = pp = ep = cp = 1, zero = 0 and no embedding_sharding (here dp = {layout.dp}, tp = {layout.tp}, pp = "
            f"{layout.pp}, ep = {layout.ep}, cp = {layout.cp}, zero = {layout.zero}); set parallel.sync='allreduce' or "
            "change the layout")
    if layout.loss_scaling:
        raise ConfigError(f"parallel.sync = {layout.sync!r} does not take fp16 loss scaling; set precision.dtype='bf16' "
                          "or 'fp32'")
