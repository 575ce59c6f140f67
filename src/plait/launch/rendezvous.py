"""A one-machine job's rendezvous, on loopback only.

torchrun's agent keeps the rendezvous state in a c10d TCPStore and unpickles it on every read; the store also
carries the workers' process-group bootstrap. torch binds that store to every interface, so anyone who can reach
the port can write a pickle under the job's key and the agent runs it. A job on one machine needs no network:
the `plait-local` backend (registered here, used by plait.launch.torchrun when launch.nnodes = 1 and no
launch.rdzv_endpoint is set) hosts the same c10d rendezvous on stores bound to 127.0.0.1, under a random run id.
Several machines must use the network: there the rendezvous port must be reachable only from the job's nodes
(docs/cluster.md, docs/security.md), and node 0's launcher says so when it starts.
"""

from __future__ import annotations

import socket
import uuid
from datetime import timedelta

BACKEND = "plait-local"
LOOPBACK = "127.0.0.1"


def loopback_store(timeout_s: float = 60.0):
    """A c10d TCPStore server listening on 127.0.0.1 only (torch's own would listen on every interface)."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((LOOPBACK, 0))
    sock.listen(1024)
    store = dist.TCPStore(LOOPBACK, sock.getsockname()[1], is_master=True, multi_tenant=True,
                          master_listen_fd=sock.detach(), wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    return store


def _create_handler(params):
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    class LocalBackend(C10dRendezvousBackend):
        @property
        def name(self) -> str:  # torch checks that the handler's backend is the one asked for
            return BACKEND

    store = loopback_store(float(params.get_as_int("read_timeout", 60)))
    handler = create_handler(store, LocalBackend(store, params.run_id), params)
    handler._create_tcp_store_server = lambda addr, port: loopback_store()  # the workers' shared store, too
    return handler


def register() -> None:
    """Make `rdzv_backend = "plait-local"` known to torch's agent (once per process)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

    if BACKEND not in registry._registry:
        registry.register(BACKEND, _create_handler)


def local_run_id(run_dir_name: str) -> str:
    """A single-machine run id no other process can guess (the run directory's name is public)."""
    return f"plait-{run_dir_name}-{uuid.uuid4().hex}"


def exposure_line(endpoint: str) -> str:
    """What node 0's launcher prints when it hosts a multi-node rendezvous."""
    return (f"plait: this node hosts the job's rendezvous at {endpoint} on every interface: let only the job's nodes "
            "reach that port (torch's agent unpickles what it reads there; see docs/security.md)")


__all__ = ["BACKEND", "exposure_line", "local_run_id", "loopback_store", "register"]
