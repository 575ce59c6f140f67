"""Parameter server over torch.distributed.rpc (`parallel.sync = 'ps'`): sync, async and bounded staleness.

    plait train job.toml --set parallel.sync=ps --set parallel.dp=4 --set parallel.ps_servers=2 \\
                         --set parallel.ps_mode=ssp --set parallel.staleness=2

The job has dp workers (ranks 0..dp-1) and ps_servers servers (ranks dp..); each rank's role comes
from plait.parallel.layout. Servers own shards of the parameters balanced by bytes, with the
optimizer state (plait.ps.server); workers push gradients and pull parameters (plait.ps.client)
through the parameter-server scheme (plait.parallel.ps), which runs plait's training loop on every
worker. Worker 0 checkpoints the servers' state under the plain model's names, so a run resumes,
exports and changes layout like any other.
"""
