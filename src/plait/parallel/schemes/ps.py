"""The parameter server (plait.parallel.ps): the layouts it serves, and what an elastic one must keep sound."""

from __future__ import annotations

from plait.errors import ConfigError
from plait.parallel.keys import ParameterServerKeys
from plait.parallel.layout import Layout
from plait.parallel.scheme import Scheme, require_plain_data_parallel


def check(layout: Layout, keys: ParameterServerKeys) -> None:
    if layout.sync != "ps":
        return
    require_plain_data_parallel(layout)
    check_elastic(layout, keys)
    if keys.ps_placement == "colocated":
        return  # dp processes, each a worker and a server: parallel.ps_servers is not used
    if keys.ps_servers < 1:
        raise ConfigError(f"parallel.ps_servers = {keys.ps_servers} must be >= 1 (parameter-server processes); "
                          "set --set parallel.ps_servers=1")
    if layout.dp < keys.ps_servers:
        raise ConfigError(
            f"parallel.sync = 'ps' with parallel.ps_servers = {keys.ps_servers} servers but only parallel.dp = "
            f"{layout.dp} workers: a server without a worker of its own is wasted; set parallel.ps_servers <= "
            f"{layout.dp} or parallel.dp >= {keys.ps_servers}")


def check_elastic(layout: Layout, keys: ParameterServerKeys) -> None:
    """launch.nnodes = MIN:MAX for a parameter server: what stays sound when machines leave or join.

    Workers hold no state, so an async or SSP job goes on without those of a machine that left (the servers count
    them out), and one that joins re-forms the job (torchrun's agent restarts every process; the chief loads the
    last checkpoint into the servers, every other worker pulls from them). Refused: sync (every round needs every
    worker), colocated servers (a leaving worker takes its shard with it), and a machine count at which the
    servers leave no worker or the global batch does not split over the workers.
    """
    lo, hi = layout.nodes
    if lo == hi:
        return
    what = f"parallel.sync = 'ps' with launch.nnodes = {lo}:{hi}"
    if keys.ps_mode == "sync":
        raise ConfigError(f"{what}: parallel.ps_mode = 'sync' needs every worker at every step, and an elastic job goes "
                          "on without some; set parallel.ps_mode = 'async' or 'ssp', or launch.nnodes to a fixed number "
                          "of machines")
    if keys.ps_placement == "colocated":
        raise ConfigError(f"{what}: with parallel.ps_placement = 'colocated' a worker that leaves takes its shard of the "
                          "parameters with it; set parallel.ps_placement = 'dedicated', or launch.nnodes to a fixed "
                          "number of machines")
    servers, micro, global_batch = keys.ps_servers, layout.micro_batch, layout.global_batch
    per_node = layout.nproc_per_node or max(1, (layout.dp + servers) // hi)
    for nodes in range(lo, hi + 1):
        workers = nodes * per_node - servers
        if workers < 1:
            raise ConfigError(
                f"{what}: at {nodes} machine(s) x {per_node} processes the {servers} parameter server(s) leave no "
                f"worker; set launch.nnodes to at least {-(-(servers + 1) // per_node)}:{hi}, or more processes "
                "per machine")
        if global_batch % (micro * workers):
            raise ConfigError(
                f"{what}: at {nodes} machine(s) the job has {workers} workers, and train.global_batch_size "
                f"({global_batch}) is not divisible by train.micro_batch_size ({micro}) * "
                f"{workers}; choose a micro batch size that divides the global batch at every size")


SCHEME = Scheme("parameter_server", applies=lambda layout, keys: layout.sync == "ps", keys=ParameterServerKeys,
                check=check, strategy="plait.parallel.ps:build", serve="plait.parallel.ps:serve")
