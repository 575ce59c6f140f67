"""Pipeline parallel over RPC (`parallel.pp_transport = "rpc"`): each stage a RemoteModule, backward through
distributed autograd (Deep Learning at Scale ch. 9, exercise 4).

Rank 0 drives. It holds stage 0 itself and reaches stage k on pipeline rank k through a RemoteModule (made from
the stage that rank built, so every layout starts from the same weights). A step streams the micro-batches:
for each one, stage 0's forward runs here and its output goes to stage 1 by `rpc.remote` (an RRef: the driver does
not wait), stage k's output RRef to stage k + 1, the last stage's output comes back by `rpc_async`; so stage 1
works on micro-batch i + 1 while stage 2 works on i (GPipe's forward fill, every forward before any backward).
The mean of the micro-batches' losses is backpropagated through all stages by distributed autograd in one
context; its gradients are handed to each stage's parameters where they live, and each rank's own optimizer
steps its own stage, as torch's DistributedOptimizer does, but with plait's learning-rate schedule, clipping by the
global norm and checkpoints (the DistributedOptimizer has no schedule and no state_dict).

Everything else is the collective pipeline's (plait.parallel.pipeline): the gradient norm summed over the stages,
a tied weight's copies summed, evaluation, checkpoints under the plain model's names. A stage whose process dies is
an error naming the stage and its rank: its RPC fails (TensorPipe sees the connection close), the driver stops the
job, the others leave their collective with it.
"""

from __future__ import annotations

import threading
import time
import uuid
import warnings

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn as nn
from torch.distributed.nn import RemoteModule

from plait.comm import accounting
from plait.errors import ConfigError
from plait.parallel import pipeline
from plait.parallel.pipeline import PipelineStrategy
from plait.parallel.scheme import Build
from plait.ps.rpc import start_agent

# this process's stages by (job token, stage index): what a RemoteModule made on this rank wraps
_STAGES: dict[tuple[str, int], nn.Module] = {}
_LOCK = threading.Lock()  # one micro-batch at a time through a stage (RPC serves requests on a thread pool)
_STARTED: list[str] = []  # the job whose RPC this process started: torch keeps its RRef context for the process's life


class StageLost(RuntimeError):
    """A pipeline stage's process stopped answering."""


def stage_name(k: int) -> str:
    return f"stage{k}"


def registered_stage(token: str, k: int) -> nn.Module:
    """RemoteModule's module_cls: the stage this rank built (not a new one: the weights must be the job's)."""
    return _STAGES[(token, k)]


def run_stage(module_rref, prev, dtype: torch.dtype):
    """On a stage's rank: its forward on the previous stage's output (a tensor, a tuple, or an RRef of either), under
    the driver's autocast dtype."""
    h = prev.to_here() if isinstance(prev, rpc.RRef) else prev
    module = module_rref.local_value()
    device = next(module.parameters()).device
    with _LOCK, torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        out = module(*(h if isinstance(h, tuple) else (h,)))
    # what this stage sends: its output on (forward), its input's gradient back (backward, the same size)
    accounting.record("rpc_pipeline", nbytes(out) + nbytes(h))
    return out


def nbytes(h) -> int:
    return sum(t.numel() * t.element_size() for t in (h if isinstance(h, tuple) else (h,)))


def alive() -> bool:
    """What the driver asks a stage that may be gone."""
    return True


def take_grads(context_id: int, module_rref) -> None:
    """On a stage's rank: the context's gradients become its parameters' .grad, for its optimizer."""
    take_local(context_id, module_rref.local_value())


def start_rpc(rank: int, world: int, timeout_s: float, token: str) -> None:
    """This rank's RPC agent, meeting the others through the store of the process group they are in (under a key
    prefix of this job's own: a process that ran an earlier job keeps no stale keys in the way)."""
    if _STARTED:
        raise ConfigError(f"parallel.pp_transport = 'rpc': this process already ran an RPC pipeline (job {_STARTED[0]}), "
                          "and torch's RPC cannot start twice in one process (its RRef context outlives the first "
                          "agent); run each such job in fresh processes, as `plait train` does")
    _STARTED.append(token)
    # the default group's store: however it was made (torchrun's agent, env://, a test's file), the ranks share it
    store = dist.PrefixStore(f"plait/rpc-pipeline/{token}", dist.distributed_c10d._get_default_store())
    start_agent(stage_name(rank), rank, world, store, timeout_s)


class RPCPipelineStrategy(PipelineStrategy):
    """One stage per pipeline rank; pipeline rank 0 drives the step by RPC."""

    timeout_s = 300.0  # RPC's own timeout (launch.timeout_s, set by build); a dead stage is seen at once regardless

    def _make_schedule(self) -> None:
        self.name = "pipeline-rpc"
        self.part = self.parts[0]
        self.me = dist.get_rank(self.pp_group)
        self.driver = self.me == 0
        self.remote: list[RemoteModule] = []
        self.token: str | None = None  # RPC starts with the first step (evaluation and resume need none)

    def _start(self) -> None:
        token = torch.tensor([uuid.uuid4().int % 2**62 if self.driver else 0], device=self.rt.device)
        dist.broadcast(token, src=dist.get_global_rank(self.pp_group, 0), group=self.pp_group)
        self.token = f"{int(token.item()):x}"
        _STAGES[(self.token, self.me)] = self.part
        start_rpc(self.me, self.pp, self.timeout_s, self.token)
        device = "cpu" if self.rt.device.type == "cpu" else str(self.rt.device)
        # the other stages as RemoteModules (RPC requests to the rank holding each); module_cls may be any callable
        # that returns the module, here the stage that rank built
        self.remote = [RemoteModule(f"{stage_name(k)}/{device}", registered_stage,  # type: ignore[arg-type]
                                    args=(self.token, k))
                       for k in range(1, self.num_stages)] if self.driver else []

    def forward_backward(self, micro_batches) -> torch.Tensor:
        if self.token is None:
            self._start()
        self.events = []
        t0 = time.time()
        loss = torch.zeros((), device=self.rt.device)
        try:
            # every stage has stepped its optimizer before the driver sends this step's micro-batches: a forward must
            # not run on weights that its backward finds changed
            dist.barrier(group=self.pp_group)
            if self.driver:
                loss = self._drive(micro_batches)
        except RuntimeError as e:
            lost = self._lost(e) if self.driver else ""
            self._stop()
            if not lost:
                raise
            raise StageLost(lost) from e
        dist.broadcast(loss, src=dist.get_global_rank(self.pp_group, 0), group=self.pp_group)
        self._record_step(t0, time.time() - t0)
        self._sync_tied()
        return loss

    def _drive(self, micro_batches) -> torch.Tensor:
        """All micro-batches forward through the stages (not waiting between them), one backward, the gradients
        handed to each stage's parameters."""
        dtype = self.precision.dtype
        with dist_autograd.context() as ctx:
            futures, targets, sent = [], [], 0
            for mb, (x, y) in enumerate(micro_batches):
                t = time.time()
                with self.precision.autocast():
                    h = self.part(x)
                self.events.append((0, "F", mb, t, time.time()))
                sent += nbytes(h)
                prev = h
                for rm in self.remote[:-1]:
                    prev = rpc.remote(rm.module_rref.owner(), run_stage, args=(rm.module_rref, prev, dtype))
                last = self.remote[-1].module_rref
                futures.append(rpc.rpc_async(last.owner(), run_stage, args=(last, prev, dtype)))
                targets.append(y)
            outputs = torch.futures.wait_all(futures)
            # what the driver sends: stage 0's outputs on, the loss's gradient of each output back to the last stage
            accounting.record("rpc_pipeline", sum(nbytes(o) for o in outputs) + sent)
            losses = [self.loss_fn(out, y) for out, y in zip(outputs, targets)]
            loss = torch.stack(losses).mean()
            dist_autograd.backward(ctx, [loss])
            take_local(ctx, self.part)
            for fut in [rpc.rpc_async(rm.module_rref.owner(), take_grads, args=(ctx, rm.module_rref))
                        for rm in self.remote]:
                fut.wait()
        return loss.detach().float()

    def _lost(self, e: RuntimeError) -> str:
        """The error naming the stage that stopped answering (the first whose agent is gone), with RPC's own."""
        for k in range(1, self.num_stages):
            try:
                rpc.rpc_sync(stage_name(k), alive, timeout=5)
            except RuntimeError:
                return (f"pipeline stage {k} (pipeline rank {k}, global rank "
                        f"{dist.get_global_rank(self.pp_group, k)}) stopped answering: {e}")
        return ""

    def _stop(self, graceful: bool = False) -> None:
        if self.token is not None:
            _STAGES.pop((self.token, self.me), None)
            self.token = None
            with warnings.catch_warnings():  # RPC's own gloo group (its shutdown's all-gather) warns of its use
                warnings.simplefilter("ignore")
                rpc.shutdown(graceful=graceful)  # graceful: every stage meets here, nobody closes a connection in use

    def finish(self) -> None:
        self._stop(graceful=True)

    def report(self) -> dict:
        return {"pp_rank": self.me, "stages": self.stage_ids, "step_events": [], "peak_inflight": 0, "timeline": []}

    def figures(self, reports: list[dict], run_dir) -> dict:
        return {"pipeline": {"schedule": "rpc", "transport": "rpc", "stages": self.num_stages,
                             "microbatches": self.microbatches, "stage_blocks": [[a, z] for a, z in self.bounds]}}


def take_local(context_id: int, module: nn.Module) -> None:
    """The gradients distributed autograd accumulated in the context for this module's parameters, as their .grad."""
    grads = dist_autograd.get_gradients(context_id)
    for p in module.parameters():
        g = grads.get(p)
        p.grad = None if g is None else g.clone()


def build(b: Build) -> RPCPipelineStrategy:
    strategy = pipeline.build(b, RPCPipelineStrategy)
    assert isinstance(strategy, RPCPipelineStrategy)
    strategy.timeout_s = float(b.cfg.launch.timeout_s)
    return strategy
