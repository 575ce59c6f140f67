"""Parameter server over torch.distributed.rpc (`parallel.sync = 'ps'`): sync, async and bounded staleness.

    plait train job.toml --set parallel.sync=ps --set parallel.dp=4 --set parallel.ps_servers=2 \\
                         --set parallel.ps_mode=ssp --set parallel.staleness=2

The job has dp workers (ranks 0..dp-1) and ps_servers servers (ranks dp..); each rank derives its
role from its rank (plait.runtime). Servers own shards of the parameters balanced by bytes, with
the optimizer state (plait.ps.server); workers push gradients and pull parameters
(plait.ps.client, plait.parallel.ps). Worker 0 runs plait's trainer and checkpoints the servers'
state under the plain model's names, so a run resumes, exports and changes layout like any other.
"""

from __future__ import annotations

from pathlib import Path


def run_role(cfg, rt, run_dir: Path | None, resume: bool):
    """The loop of a parameter-server rank that is not the chief worker; returns a TrainResult like train()."""
    from plait.ps.worker import run_server, run_worker
    from plait.train.trainer import TrainResult

    summary = run_server(cfg, rt, run_dir) if rt.role == "server" else run_worker(cfg, rt, run_dir, resume)
    return TrainResult(summary, None, None, rt)


__all__ = ["run_role"]
