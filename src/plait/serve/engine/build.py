"""The continuous-batching engine of one served language model, built from `plait serve`'s options: its draft
model (--draft), its LoRA adapters (--lora), its tensor-parallel ranks (--tp) or its pipeline stages (--pp), each
checked first.

The server's process builds it from its ServeOptions; a replica process (plait.serve.fleet.replica_worker) from
`EngineOptions`, the part of them an engine reads, which crosses the pipe as a plain dict."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from plait.errors import ConfigError
from plait.models.protocols import check_tensor_parallel
from plait.serve.engine.adapters import install_adapters, load_adapter
from plait.serve.engine.core import Engine, EngineConfig
from plait.serve.engine.pp import PipelineGroup, pipeline_plan
from plait.serve.engine.tp import TensorParallelGroup, shard
from plait.serve.errors import ServeError
from plait.serve.model.load import DECODERS, ModelRef, ServedModel, load_model


@dataclass(frozen=True)
class EngineOptions:
    """What `build_engine` reads of `plait serve`'s options, for a process that has no ServeOptions (a replica)."""

    engine_config: EngineConfig
    threads: int  # torch threads of the engine's step
    draft: str | None = None
    num_speculative_tokens: int = 4
    lora: tuple[str, ...] = ()
    tp: int = 1
    trust_checkpoint: bool = False
    pp: int = 1

    @classmethod
    def of(cls, opts, threads: int) -> EngineOptions:
        """From a ServeOptions (any object with its fields), for an engine stepping on `threads` threads."""
        return cls(opts.engine_config, threads, opts.draft, opts.num_speculative_tokens, tuple(opts.lora), opts.tp,
                   opts.trust_checkpoint, opts.pp)

    def to_dict(self) -> dict:
        """Plain values only: a replica unpickles its arguments before torch is imported (fleet.coldstart)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> EngineOptions:
        return cls(**(d | {"engine_config": EngineConfig(**d["engine_config"]), "lora": tuple(d["lora"])}))

    @property
    def block_size(self) -> int:
        return self.engine_config.block_size

    def threads_per(self, processes: int, in_process: bool = False, engine: bool = False) -> int:
        return self.threads


def build_engine(served: ServedModel, ref: ModelRef, opts, device: torch.device
                 ) -> tuple[Engine, list[str], TensorParallelGroup | PipelineGroup | None]:
    """(the engine, the --lora names in adapter order, the tensor-parallel or pipeline group or None); `opts` a
    ServeOptions or an EngineOptions. Under --pp, `served.module` becomes this process's stage (on `device`)."""
    draft = _draft(served, opts, device) if opts.draft is not None else None
    router, names = None, []
    if opts.lora:
        adapters = [load_adapter(spec.partition("=")[0], spec.partition("=")[2], served.module, opts.trust_checkpoint)
                    for spec in opts.lora]
        router = install_adapters(served.module, adapters)
        names = [a.name for a in adapters]
    group = _tensor_parallel(served, ref, opts) if opts.tp > 1 else _pipeline(served, ref, opts, device) if (
        opts.pp > 1) else None
    try:
        engine = Engine(served.module, opts.engine_config, device, threads=opts.threads_per(1, True, group is None),
                        draft=draft, num_speculative=opts.num_speculative_tokens, router=router, tp=opts.tp,
                        announce=group.announce if group is not None else None,
                        broken=group.broken if isinstance(group, TensorParallelGroup) else None,
                        blocks=group.num_blocks if isinstance(group, PipelineGroup) else None)
    except ValueError as e:
        if group is not None:
            group.abort()
        raise ServeError(str(e)) from None
    return engine, names, group


def _tensor_parallel(served: ServedModel, ref: ModelRef, opts) -> TensorParallelGroup:
    """--tp N: start ranks 1..N-1, then shard this process's model as rank 0."""
    try:  # before any process starts: the heads, kv heads, widths and vocabulary divide over tp
        check_tensor_parallel(served.module, opts.tp)
    except ConfigError as e:
        raise ServeError(f"--tp {opts.tp}: {e}") from None
    num_blocks = Engine.pool_blocks(served.module, opts.engine_config, tp=opts.tp)
    group = TensorParallelGroup(ref, opts.tp, num_blocks, opts.block_size, opts.threads_per(opts.tp))
    try:
        served.module = shard(served.module, opts.tp).eval()
        group.wait_ready()
    except BaseException:
        group.abort()
        raise
    return group


def _pipeline(served: ServedModel, ref: ModelRef, opts, device: torch.device) -> PipelineGroup:
    """--pp K: start stages 1..K-1, then keep stage 0 of this process's model, on `device`."""
    bounds, num_blocks = pipeline_plan(served.module, opts.pp, opts.engine_config)  # before any process starts
    group = PipelineGroup(ref, bounds, num_blocks, opts.block_size, opts.threads_per(opts.pp), device.type)
    try:
        served.module = group.first_stage(served.module).to(device)
        group.wait_ready()
    except BaseException:
        group.abort()
        raise
    return group


def _draft(served: ServedModel, opts, device: torch.device):
    """The draft model of --draft, checked: a generating model with the served model's vocabulary."""
    draft = load_model(ModelRef(opts.draft, trust_checkpoint=opts.trust_checkpoint))
    if not isinstance(draft.module, DECODERS):
        raise ServeError(f"--draft {opts.draft}: a {draft.registry_name} model cannot draft tokens; give a gpt "
                         "or llama run, or a Hugging Face directory")
    theirs, ours = int(draft.module.vocab_size), int(getattr(served.module, "vocab_size", -1))
    if theirs != ours:  # the real vocabularies (the heads may be padded alike)
        raise ServeError(f"--draft {opts.draft} has a vocabulary of {theirs} tokens and the served "
                         f"model {ours}: a draft must share the served model's tokenizer")
    return draft.module.to(device)
