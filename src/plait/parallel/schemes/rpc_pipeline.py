"""Pipeline stages over RPC (plait.parallel.rpc_pipeline): one plain stage per process, GPipe's schedule."""

from __future__ import annotations

from plait.errors import ConfigError
from plait.parallel.keys import PipelineKeys
from plait.parallel.layout import Layout
from plait.parallel.scheme import Scheme
from plait.parallel.schemes import pipeline


def applies(layout: Layout, keys: PipelineKeys) -> bool:
    return layout.pp > 1 and keys.pp_transport == "rpc"


def check(layout: Layout, keys: PipelineKeys) -> None:
    """The RPC pipeline runs plain stages, one per rank, GPipe's schedule, fp32 or bf16."""
    if keys.pp_transport != "rpc":
        return
    if layout.pp == 1:
        raise ConfigError("parallel.pp_transport = 'rpc' runs pipeline stages over RPC: set parallel.pp >= 2")
    refused = [f"{k} = {v!r}" for k, v, bad in (
        ("parallel.dp", layout.dp, layout.dp > 1), ("parallel.tp", layout.tp, layout.tp > 1),
        ("parallel.zero", layout.zero, layout.zero > 0), ("parallel.ep", layout.ep, layout.ep > 1),
        ("parallel.cp", layout.cp, layout.cp > 1),
        ("parallel.virtual_stages", layout.virtual_stages, layout.virtual_stages > 1),
        ("precision.dtype", "fp16", layout.loss_scaling)) if bad]
    if refused:
        raise ConfigError(f"parallel.pp_transport = 'rpc' runs one plain stage per process (pp only, fp32 or bf16); "
                          f"it does not combine with {', '.join(refused)}: drop them or set pp_transport = 'collective'")
    if keys.pp_schedule != "gpipe":
        raise ConfigError(f"parallel.pp_transport = 'rpc' runs GPipe's schedule (every micro-batch forward, then one "
                          f"backward through distributed autograd); set parallel.pp_schedule='gpipe' (it is "
                          f"{keys.pp_schedule!r})")


SCHEME = Scheme("rpc_pipeline", applies=applies, keys=PipelineKeys, check=check, check_model=pipeline.check_model,
                strategy="plait.parallel.rpc_pipeline:build")
