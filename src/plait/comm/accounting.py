"""Bytes on the wire, counted by wrapping torch.distributed's collectives.

    counter = CommCounter()
    with counting(counter):
        ...                       # DDP (through a Python comm hook), FSDP2, ZeRO-1, pipeline sends
    counter.bytes_sent            # bytes this rank sent

Every collective call is intercepted and its tensors measured; the bytes *this rank
sends* follow from the tensor sizes and the group size n by the ring algorithm, the
model behind nccl-tests' bus bandwidth:

    all_reduce(B)                  2 (n-1)/n * B
    all_gather(output B)           (n-1)/n * B
    reduce_scatter(input B)        (n-1)/n * B
    broadcast(B), reduce(B)        (n-1)/n * B   (pipelined chain: all but one rank forward B)
    all_to_all(input B)            (n-1)/n * B
    send(B)                        B

so the ZeRO paper's volumes can be checked: data parallel moves 2 Psi per step
(all-reduce, or reduce-scatter + all-gather), ZeRO-3 3 Psi.

Not seen: DTensor's functional collectives (torch.distributed._functional_collectives), which
bypass these Python entry points; FSDP2 reduces a gradient-norm scalar that way.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import threading
import time
from collections import Counter, defaultdict

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from plait import faults
from plait.comm.algorithms import all_reduce


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    return 0


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else dist.get_world_size()


# op name -> (the parameter naming the tensor(s) that size it, factor(n)); bytes sent = factor(n) * bytes
RULES: dict[str, tuple[str, object]] = {
    "all_reduce": ("tensor", lambda n: 2 * (n - 1) / n),
    "all_gather_single": ("output_tensor", lambda n: (n - 1) / n),
    "all_gather": ("tensor_list", lambda n: (n - 1) / n),
    "reduce_scatter_single": ("input", lambda n: (n - 1) / n),
    "reduce_scatter": ("input_list", lambda n: (n - 1) / n),
    "broadcast": ("tensor", lambda n: (n - 1) / n),
    "reduce": ("tensor", lambda n: (n - 1) / n),
    "all_to_all_single": ("input", lambda n: (n - 1) / n),
    "send": ("tensor", lambda n: 1.0),
    "isend": ("tensor", lambda n: 1.0),
}
# Deprecated spellings (all_gather_into_tensor, reduce_scatter_tensor) forward to the *_single functions
# through distributed_c10d's module globals, which are wrapped too: they are counted there.


class CommCounter:
    """Bytes sent, calls made and seconds spent waiting in collectives by this rank.

    fingerprinter: a plait.comm.fingerprint.Fingerprinter that compares every collective across
    ranks before it runs (launch.check_collectives). `last_call` describes the latest collective,
    for the error that explains a hang.
    """

    def __init__(self, fingerprinter=None) -> None:
        self.fingerprinter = fingerprinter
        self.last_call: dict = {}
        self.bytes_sent = 0.0
        self.by_op: dict[str, float] = defaultdict(float)
        self.calls: Counter = Counter()
        self.wait_s = 0.0  # from each call until its result is ready (async calls: until completion)
        self._lock = threading.Lock()

    def add(self, op: str, nbytes: float) -> None:
        self.bytes_sent += nbytes
        self.by_op[op] += nbytes
        self.calls[op] += 1

    def add_wait(self, seconds: float) -> None:
        with self._lock:  # async completions arrive on the backend's threads
            self.wait_s += seconds


def _call_site() -> str:
    """The innermost frame outside torch and this module: where the collective was asked for."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if "/torch/" not in name and not name.endswith(("accounting.py", "contextlib.py", "functools.py")):
            return f"{name.rsplit('/', 2)[-1] if '/plait/' not in name else name.split('/plait/')[-1]}:{f.f_lineno} " \
                   f"in {f.f_code.co_name}"
        f = f.f_back
    return "?"


_active: list[CommCounter] = []
_local = threading.local()


def _faults_active() -> bool:
    return "at=comm" in os.environ.get("PLAIT_FAULTS", "")


def _wrap(op: str, fn):
    tensor_name, factor = RULES[op]
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        depth = getattr(_local, "depth", 0)
        outer = depth == 0 and bool(_active)
        if outer:
            bound = sig.bind_partial(*args, **kwargs).arguments
            n = _group_size(bound.get("group"))
            tensor = bound.get(tensor_name)
            sent = factor(n) * _nbytes(tensor) if n > 1 or op in ("send", "isend") else 0.0
            site = _call_site() if any(c.fingerprinter is not None for c in _active) else None
            call = {"op": op, "shape": list(tensor.shape) if isinstance(tensor, torch.Tensor) else None,
                    "group_size": n, "site": site}
            for c in _active:
                c.add(op, sent)
                c.last_call = call
                if c.fingerprinter is not None and op not in ("send", "isend"):
                    c.fingerprinter.check(op, tensor, bound.get("group"), site)
        _local.depth = depth + 1
        t0 = time.perf_counter()
        try:
            if outer and _faults_active():  # a slow link, for tests of the bottleneck report
                faults.maybe_fire("comm", dist.get_rank(), -1)
            result = fn(*args, **kwargs)
        finally:
            _local.depth = depth
        if outer:
            counters = list(_active)
            if getattr(_local, "caller_waits", False):
                pass  # the caller times its own completion (ddp_allreduce_hook): no second callback
            elif result is not None and hasattr(result, "get_future"):  # async: count until it completes
                try:
                    result.get_future().add_done_callback(lambda fut: [c.add_wait(time.perf_counter() - t0)
                                                                       for c in counters])
                except (AttributeError, RuntimeError):
                    pass
            else:
                for c in counters:
                    c.add_wait(time.perf_counter() - t0)
        return result

    wrapper.__plait_counted__ = fn
    return wrapper


def ddp_allreduce_hook(group, bucket):
    """DDP's average of a gradient bucket (as torch's default hook), counted, its wait timed in the one callback DDP needs."""
    tensor = bucket.buffer().div_(dist.get_world_size(group))
    counters, t0 = list(_active), time.perf_counter()
    _local.caller_waits = True
    try:
        work = dist.all_reduce(tensor, group=group, async_op=True)
    finally:
        _local.caller_waits = False

    def done(fut):
        elapsed = time.perf_counter() - t0
        for c in counters:
            c.add_wait(elapsed)
        return fut.value()[0]

    return work.get_future().then(done)


class AlgorithmHookState:
    """What algorithm_hook needs: the dp group, its size, plait.comm.algorithms' all-reduce name and ranks per node,
    and the one thread that runs the all-reduces, bucket after bucket (every rank in DDP's bucket order)."""

    def __init__(self, group, algo: str, local_size: int = 1):
        self.group, self.algo, self.local_size = group, algo, local_size
        self.world = dist.get_world_size(group)
        self._worker = None

    def submit(self, fn):
        if self._worker is None:
            from concurrent.futures import ThreadPoolExecutor

            self._worker = ThreadPoolExecutor(1, thread_name_prefix="plait-allreduce")
        self._worker.submit(fn)


def algorithm_hook(state: AlgorithmHookState, bucket):
    """DDP's average of a gradient bucket through one of plait's own all-reduces (parallel.allreduce).

    The algorithm runs on the state's own thread, so that backward goes on computing the next buckets
    meanwhile (as with DDP's asynchronous all-reduce); DDP waits for the returned future at the end of
    backward. Its sends are counted one by one; submission to completion is this bucket's wait.
    """

    tensor = bucket.buffer().div_(state.world)
    counters, t0, fut = list(_active), time.perf_counter(), torch.futures.Future()

    def run():
        _local.caller_waits = True
        try:
            all_reduce(tensor, state.algo, state.group, state.local_size)
        except BaseException as e:  # noqa: BLE001 - handed to DDP, which raises it in backward
            fut.set_exception(e)
            return
        finally:
            _local.caller_waits = False
        elapsed = time.perf_counter() - t0
        for c in counters:
            c.add_wait(elapsed)
        fut.set_result(tensor)

    state.submit(run)
    return fut


_installed: dict[tuple[object, str], object] = {}


def _install() -> None:
    # One wrapper per function, set on both torch.distributed and distributed_c10d: code compares
    # these functions by identity (P2POp accepts only `isend`/`irecv` themselves).
    wrappers: dict[int, object] = {}
    for op in RULES:
        for mod in (dist, c10d):
            fn = getattr(mod, op, None)
            if fn is None or hasattr(fn, "__plait_counted__"):
                continue
            _installed[(mod, op)] = fn
            if id(fn) not in wrappers:
                wrappers[id(fn)] = _wrap(op, fn)
            setattr(mod, op, wrappers[id(fn)])


def _uninstall() -> None:
    for (mod, op), fn in _installed.items():
        setattr(mod, op, fn)
    _installed.clear()


@contextlib.contextmanager
def counting(counter: CommCounter):
    """Count this rank's collectives into `counter` while the context is open (nestable)."""
    if not _active:
        _install()
    _active.append(counter)
    try:
        yield counter
    finally:
        _active.remove(counter)
        if not _active:
            _uninstall()


def record(op: str, nbytes: float) -> None:
    """Count bytes this rank sends by another transport than torch.distributed (the parameter server's RPC)."""
    for c in _active:
        c.add(op, nbytes)
