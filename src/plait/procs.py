"""Spawned helper processes: the one way plait starts ranks, replicas and pipeline stages.

Children are spawned (not forked: the parent may hold threads and torch state), and some
settings (OMP_NUM_THREADS, GLOO_SOCKET_IFNAME) only take effect if they are in the child's
environment before it imports torch, so they are set around the start and the parent's own
environment is put back afterwards.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch.multiprocessing as mp

# torch's spawn context: its queues and pipes share tensors through shared memory.
CONTEXT = mp.get_context("spawn")


@contextmanager
def child_env(env: Mapping[str, str] | None) -> Iterator[None]:
    """Set `env` in os.environ for the processes started inside the block; restore the parent's values after."""
    env = dict(env or {})
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def spawn(target: Callable, args: tuple = (), *, name: str | None = None, env: Mapping[str, str] | None = None,
          daemon: bool = True):
    """Start target(*args) in a spawned process that sees `env` from its first line; a failed start raises."""
    proc = CONTEXT.Process(target=target, args=args, name=name, daemon=daemon)
    with child_env(env):
        proc.start()
    return proc
