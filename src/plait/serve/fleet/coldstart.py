"""A replica process's first function, kept free of heavy imports so that its cold start can be split.

    process   spawn() in the server -> this function's first line (interpreter, multiprocessing's bootstrap)
    imports   torch, plait and the runtime (everything `plait.serve.fleet.replica_worker` needs)
    load      the weights read, checked and moved, the exact batch sizes probed: until the replica is ready

The recipe arrives as a plain dict (not a ModelRef: unpickling that would import torch before the
clock starts), and so do the engine's options (EngineOptions.to_dict()) when the replica runs the engine.
Nothing here imports torch at module level; check with `python -X importtime`.
The server's side of the pipe (plait.serve.fleet.replicas) imports this module, and this module imports
the replica's side (plait.serve.fleet.replica_worker), which never imports the server's.
"""

from __future__ import annotations

import time


def replica_entry(conn, ref: dict, pad_to, threads: int, device: str, index: int, spawned_at: float,
                  engine: dict | None = None) -> None:
    entered = time.time()
    from plait.serve.fleet.replica_worker import replica_main  # start-up time: as above (torch comes with it)
    from plait.serve.model.load import ModelRef  # start-up time: these imports are the cold start's "imports" phase

    imported = time.time()
    replica_main(conn, ModelRef(**ref), pad_to, threads, device, index,
                 timing={"process_s": max(0.0, entered - spawned_at), "imports_s": imported - entered,
                         "loaded_since": imported}, engine=engine)
