"""The Strategy protocol: one object owns a layout's forward/backward/sync for a step.

The trainer loop calls, per step::

    loss = strategy.forward_backward(micro_batches)   # this rank's share of the global-batch mean loss
    norm = strategy.clip_grad_norm(max_norm, need_norm)
    strategy.optimizer_step()

Every hook has a default that is right for a single process; a scheme overrides only what its
layout changes (how gradients are synchronised, what the step is, what a checkpoint holds).
Checkpoints go through `state_dict()` / `load_state_dict()`, always keyed by the plain model's
names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn as nn

from plait.parallel.gradsync import align_grads, clip_grad_norm
from plait.parallel.saved import saved_tensors

Batch = tuple[torch.Tensor, torch.Tensor]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """Autocast and (for fp16) dynamic loss scaling."""

    def __init__(self, dtype: str, device: torch.device):
        self.dtype = DTYPES[dtype]
        self.device = device
        self.scaler = torch.amp.GradScaler(device.type) if dtype == "fp16" else None

    def autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def split_scale(self, parts: int) -> float:
        """1, or with fp16 the loss scale over `parts` micro-batches back-propagated one by one (a pipeline's schedule),
        made on every rank: a pipeline's first stages compute no loss, yet unscale their gradients."""
        if not self.scaler:
            return 1.0
        self.scaler.scale(torch.zeros((), device=self.device))  # makes the scale where no loss was scaled yet
        return self.scaler.get_scale() / parts

    def unscale(self, optimizer, group=None) -> None:
        """Unscale gradients; with sharded gradients (`group` given) every rank must agree on an overflow."""
        if not self.scaler:
            return
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if len({hasattr(g, "to_local") for g in grads}) > 1:
            self._unscale_local(optimizer, grads)  # DTensor and plain gradients (expert parallel's experts)
        else:
            self.scaler.unscale_(optimizer)
        if group is not None:
            import torch.distributed as dist

            # GradScaler decides per rank; a shard with an inf must make every rank skip the step.
            state = self.scaler._per_optimizer_states[id(optimizer)]
            for found in state["found_inf_per_device"].values():
                dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)

    def _unscale_local(self, optimizer, grads: list) -> None:
        """GradScaler.unscale_ on each gradient's local tensor: torch's fused unscale takes a list of plain tensors or
        of DTensors, not both. The scale, the found-inf flag and the optimizer's stage are the scaler's own."""
        from torch.amp.grad_scaler import OptState

        scaler = self.scaler
        assert scaler is not None and scaler._scale is not None, "unscale runs after scale(loss)"
        state = scaler._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale() has already been called on this optimizer since the last update().")
        inv_scale = scaler._scale.double().reciprocal().float()
        found_inf = torch.zeros(1, dtype=torch.float32, device=scaler._scale.device)
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for g in grads:
            local = g.to_local() if hasattr(g, "to_local") else g
            by_kind.setdefault((local.device, local.dtype), []).append(local)
        for tensors in by_kind.values():
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv_scale)
        state["found_inf_per_device"] = {found_inf.device: found_inf}
        state["stage"] = OptState.UNSCALED

    def step(self, optimizer) -> None:
        if self.scaler:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks (`model.blocks`, a ModuleList or ModuleDict), or none.

    A transformers model has no `blocks`: its units are the modules of the classes its `_no_split_modules` names
    (LlamaDecoderLayer, BertLayer, ...), outermost first, in order, as Accelerate and the HF Trainer take them.
    """
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleDict):
        return list(blocks.values())
    if isinstance(blocks, nn.ModuleList):
        return list(blocks)
    names = set(getattr(model, "_no_split_modules", None) or ())
    units: list[nn.Module] = []
    inside: set[int] = set()
    for m in model.modules():
        if id(m) in inside or type(m).__name__ not in names:
            continue
        units.append(m)
        inside.update(id(x) for x in m.modules())
    return units


@runtime_checkable
class StepStrategy(Protocol):
    """What the trainer, telemetry, evaluation, checkpoints and exports use of a strategy (Strategy implements it)."""

    name: str
    model: nn.Module  # what forward runs (possibly wrapped)
    module: nn.Module  # the plain model, with the single-process parameter names
    optimizer: torch.optim.Optimizer
    precision: Precision
    evaluates: bool  # this rank evaluates, checkpoints and writes the run's files
    labels: list[str]  # words the run's header adds to the name
    eval_metrics: dict[str, Callable] | None
    last_metrics: torch.Tensor | None
    activation_meter: Any
    optional_state: tuple[str, ...]  # state_dict entries a checkpoint of another layout may lack

    def forward_backward(self, micro_batches: list[Batch]) -> torch.Tensor: ...
    def clip_grad_norm(self, max_norm: float, need_norm: bool = True) -> torch.Tensor | None: ...
    def optimizer_step(self) -> None: ...
    def eval_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
    def stop_training(self, params: list) -> None: ...
    def step_metrics(self, record: dict) -> dict: ...
    def report(self) -> dict | None: ...
    def figures(self, reports: list[dict], run_dir) -> dict: ...
    def finish(self) -> None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...
    def full_model_state_dict(self) -> dict: ...


def correct_predictions(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """How many of a validation batch's predictions are right (float64 scalar; 0 where outputs have no classes)."""
    if logits.dim() == 2 and not y.is_floating_point():  # float targets of 2-D outputs: regression, no classes
        return (logits.argmax(-1) == y).sum().double()
    if logits.dim() == 3 and y.dim() == 2 and not y.is_floating_point():  # labels per row (few-shot queries)
        return (logits.argmax(-1) == y).double().mean(-1).sum()  # each sample's share of rows right
    if logits.dim() == 1:  # one logit per sample: a binary label
        return ((logits > 0).long() == y.long()).sum().double()
    return torch.zeros((), dtype=torch.float64, device=logits.device)


class Strategy:
    """Single-process training; the base that the schemes refine (the members of StepStrategy, with defaults)."""

    name = "single"
    sharded = False  # gradients differ between ranks that must agree on an fp16 overflow
    tensor_parallel = False  # DTensor gradients get their parameters' placements after backward
    evaluates = True  # this rank evaluates, checkpoints and writes the run's files (a parameter server's other
    # workers do not)
    optional_state: tuple[str, ...] = ()  # state_dict entries a checkpoint of another layout may lack

    def __init__(self, model: nn.Module, module: nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable, precision: Precision, local_batch: int):
        self.model = model  # what forward runs (possibly wrapped)
        self.module = module  # the plain model, with the single-process parameter names
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.precision = precision
        self.local_batch = local_batch  # samples per step on this data-parallel rank
        self.activation_meter = None  # set by the trainer on the steps where it measures memory
        self.saved_codec = None  # train.activation_compression (plait.parallel.saved), set by the trainer
        self.eval_metrics: dict[str, Callable] | None = None  # train.eval_metrics: name -> fn(outputs, targets)
        self.last_metrics: torch.Tensor | None = None  # their values on the last eval_batch, float64
        self.labels: list[str] = []  # words the run's header adds to the strategy's name (e.g. "fp16 compression")

    def no_sync(self):
        """Context in which backward does not synchronise gradients (all but the last micro-batch)."""
        return contextlib.nullcontext()

    def forward_backward(self, micro_batches: list[Batch]) -> torch.Tensor:
        """Accumulate gradients over micro-batches; returns this rank's mean loss (detached).

        Each micro-batch's mean loss is scaled by its share of the rank's batch, so the
        accumulated gradient is that of the rank's mean; data-parallel averaging then
        gives the global-batch mean whatever the accumulation count and dp.
        """
        total = None
        last = len(micro_batches) - 1
        for i, (x, y) in enumerate(micro_batches):
            ctx = self.no_sync() if i < last else contextlib.nullcontext()
            meter = saved_tensors(self.activation_meter, self.saved_codec, self.module)
            with ctx:
                with meter, self.precision.autocast():
                    loss = self.loss_fn(self.model(x), y)
                    if len(x) != self.local_batch:  # one micro-batch of the whole local batch needs no scale
                        loss = loss * (len(x) / self.local_batch)
                self.precision.backward(loss)
            total = loss.detach() if total is None else total + loss.detach()
        self.after_backward()
        assert total is not None, "a step has at least one micro-batch"
        return total

    def after_backward(self) -> None:
        """Runs once the step's gradients are complete (layouts that synchronise them by hand do it here)."""
        if self.tensor_parallel:
            align_grads(self.module.parameters())

    @torch.no_grad()
    def eval_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean loss, correct predictions) of one validation batch, as float64 scalars."""
        with self.precision.autocast():
            logits = self.model(x)
        loss = self.loss_fn(logits, y).double()
        metrics = self.eval_metrics  # set by the trainer (train.eval_metrics)
        if metrics:
            self.last_metrics = torch.stack([torch.as_tensor(fn(logits, y), dtype=torch.float64, device=logits.device)
                                             .reshape(()) for fn in metrics.values()])
        return loss, correct_predictions(logits, y)

    def clip_grad_norm(self, max_norm: float, need_norm: bool = True) -> torch.Tensor | None:
        """Clip the global gradient norm to max_norm (> 0); returns the norm when clipping or asked for it."""
        self.precision.unscale(self.optimizer, self.overflow_group())
        if max_norm <= 0 and not need_norm:
            return None
        return clip_grad_norm(self.module.parameters(), max_norm)

    def overflow_group(self):
        """The ranks that must agree on an fp16 overflow (all of them when gradients are sharded)."""
        import torch.distributed as dist

        return dist.group.WORLD if self.sharded and dist.is_initialized() else None

    def optimizer_step(self) -> None:
        self.precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)

    def stop_training(self, params: list) -> None:
        """These parameters train no more (progressive freezing): out of the optimizer, their state and gradients
        dropped. Layouts that lay gradient synchronisation out once from what trains rebuild it (DDP)."""
        self.drop_from_optimizer(params)
        for p in params:
            p.grad = None

    def drop_from_optimizer(self, params: list) -> None:
        """These parameters out of the optimizer's groups, their state dropped."""
        ids = {id(p) for p in params}
        for group in self.optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in ids]
        for p in params:
            self.optimizer.state.pop(p, None)

    def step_metrics(self, record: dict) -> dict:
        """Scheme-specific figures for a metrics.jsonl record (compression ratio, staleness, ...)."""
        return {}

    def finish(self) -> None:
        """The loop is over on this rank (a parameter-server worker tells the servers)."""

    def report(self) -> dict | None:
        """This rank's figures at the end of a run, gathered from every rank for `figures` (None: none)."""
        return None

    def figures(self, reports: list[dict], run_dir) -> dict:
        """Summary entries (and plots in run_dir) made from every rank's `report()`; rank 0 only."""
        return {}

    # ---- checkpoints: plain names, whatever the wrapping
    def state_dict(self) -> dict:
        """Model and optimizer *tensors*, keyed by the plain model's names.

        The optimizer's param_groups (lr, betas, ...) are left out on purpose: they come
        from the config (the lr from the step), so a resumed run takes its current config,
        and the checkpoint holds only tensors, which DCP reads without unpickling objects.
        """
        from torch.distributed.checkpoint.state_dict import get_state_dict  # lazily: a second of import (DTensor)

        model_sd, optim_sd = get_state_dict(self.state_module, self.optimizer)
        return {"model": model_sd, "optim": {"state": optim_sd["state"]}}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

        current = get_state_dict(self.state_module, self.optimizer)[1]
        optim_sd = {"state": state["optim"]["state"], "param_groups": current["param_groups"]}
        set_state_dict(self.state_module, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=optim_sd, options=StateDictOptions(strict=True))

    @property
    def state_module(self) -> nn.Module:
        """The module whose state_dict names are the plain model's (wrappers such as DDP are seen through)."""
        return self.model

    def full_model_state_dict(self) -> dict:
        """The whole model's weights on every rank, plain names (a collective when parameters are sharded)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.state_module, options=StateDictOptions(full_state_dict=True))
        return {k: v.detach().cpu().clone() for k, v in sd.items()}
