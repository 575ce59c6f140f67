"""Joining the parameter-server job: roles, names and torch.distributed.rpc (TensorPipe) over the job's store.

With `parallel.sync = 'ps'` the world is dp workers (ranks 0..dp-1) plus K servers (ranks dp..dp+K-1).
Nobody joins a collective process group: workers talk only to servers, by RPC, so a worker that
dies cannot leave the others stuck in a collective (Li et al. 2014's design). RPC meets through
the job's key-value store: torchrun's agent store under a launcher (a prefix per restart), else a
TCPStore at MASTER_ADDR:MASTER_PORT hosted by rank 0.
"""

from __future__ import annotations

import atexit
import datetime
import os
import warnings

import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch.distributed.rendezvous import register_rendezvous_handler

from plait.errors import ConfigError
from plait.runtime import attempt_store


def worker_name(i: int) -> str:
    return f"worker{i}"


def server_name(k: int) -> str:
    return f"ps{k}"


def rank_name(rank: int, dp: int) -> str:
    return worker_name(rank) if rank < dp else server_name(rank - dp)


def _store(rank: int, world: int, timeout: datetime.timedelta):
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        return attempt_store(world, timeout)
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        raise ConfigError("parallel.sync = 'ps' needs MASTER_ADDR and MASTER_PORT (set by plait train and torchrun)")
    return dist.TCPStore(host, int(port), world_size=world, is_master=rank == 0, timeout=timeout)


def join(rank: int, world: int, dp: int, timeout_s: float) -> None:
    """Start this rank's RPC agent and meet the others; an immediate shutdown at exit unless leave() ran before."""
    if dist.is_available() and dist.is_initialized():
        raise ConfigError("parallel.sync = 'ps' starts its own processes (dp workers + ps_servers servers) and does not "
                          "run inside an existing process group; launch it with `plait train` or torchrun")
    timeout = datetime.timedelta(seconds=timeout_s)
    start_agent(rank_name(rank, dp), rank, world, dist.PrefixStore("plait/ps", _store(rank, world, timeout)), timeout_s)
    # At exit, if nothing stopped it before: at once, without waiting for the others (some may be gone).
    atexit.register(leave, False)


def start_agent(name: str, rank: int, world: int, store, timeout_s: float) -> None:
    """This rank's TensorPipe RPC agent, meeting the others through `store` (the parameter server's, the RPC
    pipeline's)."""

    def handler(url: str, **kwargs):
        yield store, rank, world

    # RPC meets through a URL scheme: one of its own for this store, so no module state holds it.
    scheme = f"plaitrpc{id(store)}"
    register_rendezvous_handler(scheme, handler)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"{scheme}://", rpc_timeout=timeout_s,
                                           num_worker_threads=max(16, 4 * world), _transports=["uv"], _channels=["basic"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # RPC's internal gloo group (its device-map exchange) warns of its use
        rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=opts)


def leave(orderly: bool, timeout_s: float = 0.0) -> None:
    """Stop this rank's RPC agent (once; later calls do nothing).

    orderly: every rank of the job meets here, then each closes its connections (torch's graceful shutdown),
    so nobody reads an end-of-file from a peer that went first. Only for a clean end, when every rank will come
    (it waits up to timeout_s); otherwise the agent stops at once and the peers may log the closed pipes.
    """
    try:
        rpc.shutdown(graceful=orderly, timeout=timeout_s)
    except RuntimeError:  # already stopped, or an orderly end that some rank did not reach: stopped now all the same
        pass
