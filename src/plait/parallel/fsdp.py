"""ZeRO stages 2 and 3 with FSDP2 (`fully_shard`), sharded over the dp axis.

Stage 3 shards each block, then the root, and reshards parameters after forward (all-gathered
again for backward: 3 Psi per step). Stage 2 shards the root alone and keeps its parameters
unsharded from forward through backward: one all-gather before forward, one reduce-scatter
after backward (2 Psi per step, as ZeRO-1). Gradients are reduce-scattered and optimizer states
sharded in both. Parameters are sharded at rest in both as well, which FSDP2 does not let us
avoid; it only lowers stage 2's memory.

The gradient norm and the optimizer step work on the DTensors' local shards (plain tensors):
the same elementwise arithmetic without DTensor's dispatch on every op, and the norm's one
all-reduce is a torch.distributed call that plait.comm.accounting counts.

Overlap at stage 3: each block's pre-forward asks for the next block's all-gather, each block's
pre-backward for the previous block's (explicit prefetch, one unit ahead). On a GPU FSDP2 runs
its collectives on side streams; a CPU has none, so there every all-gather and reduce-scatter
would block the Python thread until the other ranks arrive. There (overlap_without_streams)
all-gathers are issued asynchronously and waited for when the block runs, and each
reduce-scatter is waited for only when the next one is issued (and the last at the end of
backward): compute goes on while gloo moves the bytes, and a rank that falls a little behind no
longer stops the other at every one of the step's 15 collectives. The same bytes move (3 Psi).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state
from torch.distributed.tensor import DTensor

from plait.comm.compression import BY_HAND, Compression, ratio_metrics
from plait.finetune.lora import shard_nf4_bases
from plait.parallel.base import DTYPES, Precision, Strategy, model_blocks
from plait.parallel.fsdp_compress import install as install_compression
from plait.parallel.gradsync import clip_grads
from plait.parallel.keys import DDPKeys
from plait.parallel.scheme import Build


def apply_fsdp(model: nn.Module, dp_mesh, stage: int, param_dtype: str = "fp32", offload: bool = False,
               ignored_params: set | None = None, reduce_dtype: torch.dtype | None = None) -> nn.Module:
    """Stage 3: shard each of model.blocks, then the root, resharding after forward; stage 2: the root alone, kept whole.

    ignored_params stay as they are (expert parallel keeps its experts out and synchronises them itself).
    reduce_dtype: gradients reduce-scattered in this dtype (parallel.compression = fp16 | bf16), else float32."""
    mp = None
    if param_dtype != "fp32" or reduce_dtype is not None:
        mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype] if param_dtype != "fp32" else None,
                                  reduce_dtype=reduce_dtype or torch.float32)
    kwargs = {"mesh": dp_mesh, "reshard_after_forward": stage == 3, "ignored_params": ignored_params}
    if mp is not None:
        kwargs["mp_policy"] = mp
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    # Stage 2 holds every parameter whole from forward through backward anyway: one group (the root) makes
    # it one all-gather and one reduce-scatter a step, not one per block, and skips the blocks' hooks.
    blocks = model_blocks(model) if stage == 3 else []
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    if blocks:  # one unit ahead, in both directions: the root asks for the first block, the last block's backward first
        for unit, following in zip([model, *blocks], blocks):
            unit.set_modules_to_forward_prefetch([following])
        for unit, previous in zip([model, *reversed(blocks)], reversed(blocks)):
            if unit is not model:
                unit.set_modules_to_backward_prefetch([previous])
        model.set_modules_to_backward_prefetch([blocks[-1]])
    return model


class DeferredReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter issued asynchronously; each call waits for the one before it, wait() for the last.

    Safe only where FSDP2 reads the output no further right after the call: an averaging reduction
    (no division after it), the gradients' own dtype (no cast), no offload, and no gradient to accumulate
    into (`defer` is cleared otherwise, and every call then waits at once)."""

    def __init__(self) -> None:
        self.pending: dist.Work | None = None
        self.defer = True
        self.calls = self.deferred = 0  # reduce-scatters issued; those left in flight when FSDP2 went on

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False) -> None:
        work = dist.reduce_scatter_single(output_tensor, input_tensor, group=group, op=op, async_op=True)
        self.wait()  # the previous unit's: at most one in flight, as FSDP2 keeps one reduce-scatter input
        self.pending = work  # gloo's work holds input_tensor until it completes
        self.calls += 1
        if self.defer:
            self.deferred += 1
        else:
            self.wait()

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None


def overlap_without_streams(model: nn.Module, dp_mesh, stage: int) -> DeferredReduceScatter | None:
    """On a device without streams (CPU), make stage 3's collectives asynchronous; the reduce-scatter to wait for.

    None where nothing changes: a device with streams (FSDP2 overlaps there already), stage 2 (one unit:
    nothing to overlap with), a unit training parameters of another dtype than float32 or bfloat16 (FSDP2
    then divides after the reduction; QLoRA's frozen uint8 codes have no gradient to reduce)."""
    units = [m for m in model.modules() if hasattr(m, "set_custom_reduce_scatter")]
    if dp_mesh.device_type != "cpu" or stage != 3 or len(units) < 2:
        return None
    if any(p.dtype not in (torch.float32, torch.bfloat16) for p in model.parameters() if p.requires_grad):
        return None
    comm = DeferredReduceScatter()
    for unit in units:
        unit.set_custom_reduce_scatter(comm)
        if hasattr(unit, "_set_unshard_async_op"):  # FSDP2 waits for each all-gather itself, as the unit runs
            unit._set_unshard_async_op(True)
    return comm


def stop_unsharded(model: nn.Module, params: list) -> None:
    """FSDP2's unsharded copies of these (frozen) sharded parameters stop requiring a gradient (FSDPStrategy)."""
    ids = {id(p) for p in params}
    for module in model.modules():
        state = _get_module_fsdp_state(module)
        group = getattr(state, "_fsdp_param_group", None) if state is not None else None
        for fsdp_param in getattr(group, "fsdp_params", []):
            if id(fsdp_param.sharded_param) in ids and hasattr(fsdp_param, "_unsharded_param"):
                fsdp_param._unsharded_param.requires_grad_(False)


class FSDPStrategy(Strategy):
    name = "fsdp"
    sharded = True

    def __init__(self, *args, stage: int, dp_group=None, reduce_scatter: DeferredReduceScatter | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.name = f"zero{stage}"
        self.dp_group = dp_group
        self.reduce_scatter = reduce_scatter
        self.init_memory: dict | None = None  # shard-only initialisation's figures (Build.materialize)

    def forward_backward(self, micro_batches) -> torch.Tensor:
        if self.reduce_scatter is not None:  # FSDP2 adds into gradients that are already there, right after the call
            self.reduce_scatter.defer = all(p.grad is None for p in self.module.parameters())
        return super().forward_backward(micro_batches)

    def after_backward(self) -> None:
        if self.reduce_scatter is not None:
            self.reduce_scatter.wait()  # the last unit's (the root's) reduce-scatter, before anything reads a gradient
        if (compression := getattr(self.model, "plait_compression", None)) is not None:
            compression.end_step()
        super().after_backward()

    def stop_training(self, params: list) -> None:
        """As the base (out of the optimizer, state and gradients dropped), and FSDP2's unsharded copies of these
        parameters stop requiring a gradient too: FSDP2 makes each once, at its first all-gather, with the sharded
        parameter's requires_grad, and reduce-scatters the gradients its copies get. Frozen, they get none: no
        gradient, no traffic, as a parameter frozen before wrapping (plait.finetune.freeze)."""
        super().stop_training(params)
        stop_unsharded(self.model, params)

    @contextlib.contextmanager
    def no_sync(self):
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def _dp_shards(self) -> list | None:
        """The parameters, when every one is a DTensor sharded over the dp axis alone (no tp, no ignored params)."""
        if self.dp_group is None or self.tensor_parallel:
            return None
        params = [p for p in self.module.parameters() if p.requires_grad]
        if all(isinstance(p, DTensor) and p.device_mesh.ndim == 1 for p in params):
            return params
        return None

    def clip_grad_norm(self, max_norm: float, need_norm: bool = True) -> torch.Tensor | None:
        """As the base, from the local gradient shards: one counted all-reduce of a float64 scalar, no DTensor ops."""
        params = self._dp_shards()
        if params is None:
            return super().clip_grad_norm(max_norm, need_norm)
        self.precision.unscale(self.optimizer, self.overflow_group())
        if max_norm <= 0 and not need_norm:
            return None
        return clip_grads([], max_norm, partial=[p.grad._local_tensor for p in params if p.grad is not None],
                          group=self.dp_group)

    def step_metrics(self, record: dict) -> dict:
        """With top-k / int8 / PowerSGD compression: the uncompressed reduce-scatter bytes per step and their ratio."""
        return ratio_metrics(getattr(self.model, "plait_compression", None), record)

    def optimizer_step(self) -> None:
        params = self._dp_shards()
        if (params is None or self.precision.scaler is not None or type(self.optimizer) not in LOCAL_STEP
                or any(p not in self.optimizer.state for p in params if p.grad is not None)):
            super().optimizer_step()  # the first step creates the state (as DTensors) through the optimizer itself
            return
        with _on_local_shards(self.optimizer):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


# Elementwise optimizers stepped on the local shards of FSDP2's DTensors: the same arithmetic on the same
# numbers, without DTensor's dispatch on every one of the step's dozens of ops per parameter.
LOCAL_STEP = (torch.optim.AdamW, torch.optim.SGD)


@contextlib.contextmanager
def _on_local_shards(optimizer: torch.optim.Optimizer):
    """While open, the optimizer's parameters, gradients and state are the DTensors' local tensors.

    Every parameter must have its state already: the local tensors are views, so the step's in-place
    updates land in the DTensors, whose state dicts come back as they were."""
    swapped, states = [], {}
    for group in optimizer.param_groups:
        swapped.append(group["params"])
        local = []
        for p in group["params"]:
            q = p._local_tensor
            q.grad = p.grad._local_tensor if p.grad is not None else None
            if p in optimizer.state:
                states[q] = (p, optimizer.state.pop(p))
                optimizer.state[q] = {k: v._local_tensor if isinstance(v, DTensor) else v for k, v in states[q][1].items()}
            local.append(q)
        group["params"] = local
    try:
        yield
    finally:
        for group, params in zip(optimizer.param_groups, swapped):
            for q in group["params"]:
                q.grad = None
                if q in states:
                    p, state = states[q]
                    optimizer.state[p] = state
                    del optimizer.state[q]
            group["params"] = params


# parallel.compression under ZeRO-2/3: what is reduce-scattered is cast to this dtype (FSDP2's reduce_dtype)
REDUCE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def transform(model: nn.Module, b: Build) -> nn.Module:
    offload = b.layout.offload == "params" and b.rt.device.type != "cpu"
    keys = b.keys(DDPKeys)
    shard_nf4_bases(model)  # QLoRA: the nf4 base sharded with the rest (FSDP-QLoRA), not held whole on every rank
    model = apply_fsdp(model, b.rt.mesh["dp"], b.layout.zero, param_dtype=b.cfg.precision.dtype, offload=offload,
                       reduce_dtype=REDUCE_DTYPES.get(keys.compression))
    if keys.compression in BY_HAND:  # top-k, int8, PowerSGD of what each unit reduce-scatters
        install_compression(model, b.rt.axis_group("dp"), Compression.from_keys(keys))
    return model


def build(b: Build) -> Strategy:
    if b.layout.offload != "none" and b.rt.device.type == "cpu":
        b.rt.print(f"note: parallel.offload = {b.layout.offload!r} has no effect on a CPU run (the shards already "
                   "live in CPU memory)")
    model = b.parallelize(b.module)
    init = b.materialize(model)  # shard-only initialisation: the single-process values, this rank's shards only
    compression = b.keys(DDPKeys).compression  # a cast reduction: FSDP2 divides after it (no deferred reduce-scatter)
    # FSDP2 casts parameters itself (its mixed-precision policy); autocast would be redundant.
    precision = Precision("fp32", b.rt.device) if b.cfg.precision.dtype == "bf16" else b.precision
    strategy = FSDPStrategy(model, b.module, b.make_optimizer(b.module), b.loss_fn, precision, b.local_batch,
                            stage=b.layout.zero, dp_group=b.rt.axis_group("dp"),
                            reduce_scatter=None if compression in REDUCE_DTYPES or compression in BY_HAND else
                            overlap_without_streams(b.module, b.rt.mesh["dp"], b.layout.zero))
    strategy.tensor_parallel = b.rt.axis_size("tp") > 1
    strategy.init_memory = init
    if compression != "none":
        strategy.labels.append(f"{compression} compression")
    return strategy
