"""PipeDream-2BW (plait.parallel.pipedream): the pipeline's stages on a cross-step schedule."""

from __future__ import annotations

from plait.errors import ConfigError
from plait.parallel.keys import PipelineKeys
from plait.parallel.layout import Layout
from plait.parallel.scheme import Scheme
from plait.parallel.schemes import pipeline


def check(layout: Layout, keys: PipelineKeys) -> None:
    """PipeDream-2BW runs plain pipeline stages (dp x pp, fp32 or bf16) with enough micro-batches to stream."""
    if keys.pp_schedule != "pipedream" or layout.pp == 1:
        return
    refused = [f"{k} = {v!r}" for k, v, bad in (
        ("parallel.tp", layout.tp, layout.tp > 1), ("parallel.zero", layout.zero, layout.zero > 0),
        ("parallel.virtual_stages", layout.virtual_stages, layout.virtual_stages > 1),
        ("precision.dtype", "fp16", layout.loss_scaling)) if bad]
    if refused:
        raise ConfigError(f"parallel.pp_schedule = 'pipedream' runs plain pipeline stages (dp x pp, fp32 or bf16); "
                          f"it does not combine with {', '.join(refused)}: set pp_schedule = '1f1b' or drop them")
    m = layout.pipeline_microbatches
    if m < layout.pp:
        raise ConfigError(f"parallel.pp_schedule = 'pipedream' needs at least parallel.pp ({layout.pp}) micro-batches "
                          f"per step (it has {m}); set parallel.microbatches={layout.pp}")


SCHEME = Scheme("pipedream", applies=lambda layout, keys: layout.pp > 1 and layout.schedule == "pipedream",
                keys=PipelineKeys, check=check, check_model=pipeline.check_model, strategy="plait.parallel.pipedream:build")
