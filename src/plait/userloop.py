"""Your own training loop on plait's layouts: `plait.parallelize(model, config)` owns the step, you own the loop.

    p = plait.parallelize(model, loss=F.cross_entropy)      # config: the one `plait launch` passed (PLAIT_CONFIG)
    for batch in p.batches(dataset, steps=100):             # 100 steps from here; plait's layout-independent sampler
        out = p.step(batch, max_norm=1.0)                   # forward, backward, sync, clip, optimizer: out.loss, out.grad_norm
    p.save(run_dir, step=100)                               # DCP checkpoint, plain names; p.load(run_dir) -> step
    weights = p.state_dict()                                # the whole plain model's weights, on every rank
    p.close()

The layout is the config's (parallel.dp, zero, tp, pp, compression, precision): the same Scheme objects as
`plait train` (plait.parallel.SCHEMES) apply it, so a run of your loop and of `plait train` take the same
steps. Without a launcher (`python script.py`) the loop runs on one process with the same global batch.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from plait.config import Config, load_config, validate_config
from plait.data.loader import StepLoader
from plait.data.sampler import make_sampler
from plait.errors import ConfigError, PlaitError
from plait.launch.job import fit_to_world
from plait.launch.script import CONFIG_ENV, refuse_roles
from plait.parallel import SCHEMES, Build, Precision, build_strategy, check_config
from plait.train.checkpoint import Checkpointer, checkpoint_dir, find_resumable, load_checkpoint, step_name
from plait.train.loss import with_extra_loss
from plait.train.optim import build_optimizer, lr_at, set_lr

# how long a rank waits for the others at a collective call of Parallel before it names the call
ARRIVAL_S = float(os.environ.get("PLAIT_ARRIVAL_TIMEOUT_S", "60"))


class CollectiveError(PlaitError):
    """A collective call of Parallel (save, load, state_dict) made by some ranks only."""


class StepResult:
    """What p.step returns: the global batch's mean loss (every rank gets the same) and the global gradient norm before
    clipping, as floats. Both are read when first used, not at the step: the step waits on neither (no host-device
    sync), and the loss's average over dp, started on every rank at the step, is waited for only then, so reading it
    on rank 0 alone (`if p.is_main: print(out.loss)`) is fine."""

    __slots__ = ("_loss", "_norm", "_work", "_dp", "_values")

    def __init__(self, loss: torch.Tensor, norm: torch.Tensor | None, work=None, dp: int = 1):
        self._loss, self._norm, self._work, self._dp = loss, norm, work, dp
        self._values: tuple[float, float] | None = None

    def _read(self) -> tuple[float, float]:
        if self._values is None:
            self.wait()
            norm = float("nan") if self._norm is None else float(self._norm)
            self._values = (float(self._loss) / self._dp, norm)
        return self._values

    def wait(self) -> None:
        """The loss's all-reduce has finished (p.step calls this for the step before: it is done by then)."""
        if self._work is not None:
            self._work.wait()
            self._work = None

    @property
    def loss(self) -> float:
        return self._read()[0]

    @property
    def grad_norm(self) -> float:
        return self._read()[1]

    def __repr__(self) -> str:
        return f"StepResult(loss={self.loss!r}, grad_norm={self.grad_norm!r})"


class _MapData:
    """A map-style dataset (`__len__`, `__getitem__` -> (input, target)) as plait's loader fetches it."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def fetch(self, idx: torch.Tensor):
        from torch.utils.data import default_collate

        return default_collate([self.dataset[int(i)] for i in idx])


def resolve_config(config: Config | str | Path | None) -> Config:
    """The config given, else PLAIT_CONFIG (set by `plait launch`), else the defaults on one process."""
    if isinstance(config, Config):
        cfg = config
    elif config is not None:
        cfg = load_config(config)
    elif os.environ.get(CONFIG_ENV):
        cfg = load_config(os.environ[CONFIG_ENV])
    else:
        cfg = load_config(None)
    validate_config(cfg)
    refuse_roles(cfg)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and "RANK" not in os.environ:  # `python script.py`: the same loop, global batch and steps, one process
        cfg = fit_to_world(_no_sharding(cfg), 1) if cfg.parallel.tp == cfg.parallel.pp == 1 else cfg
    return cfg


def _no_sharding(cfg: Config) -> Config:
    import copy

    cfg = copy.deepcopy(cfg)
    cfg.parallel.zero, cfg.parallel.compression = 0, "none"
    return cfg


class Parallel:
    """The user's model under the configured layout: the step, data, checkpoints (see the module docstring)."""

    def __init__(self, model: nn.Module, cfg: Config, loss: Callable, optimizer: Callable | None = None):
        layout = check_config(cfg, model=model)  # pipeline cut points and the TP plan of *this* model
        self.cfg, self.layout = cfg, layout
        # a process group that exists already (a test harness's, the user's) is left to whoever made it
        self._owns_group = not (dist.is_available() and dist.is_initialized())
        self.rt = layout.init_runtime(cfg.launch)
        model = model.to(self.rt.device)
        if self.rt.distributed:  # every rank starts from rank 0's weights, however the script seeded
            with torch.no_grad():
                for t in [*model.parameters(), *model.buffers()]:
                    dist.broadcast(t.data, src=0)
        self._schedule = optimizer is None  # plait's optimizer follows optim.* (its lr schedule too)

        def make_optimizer(m: nn.Module, only=None):
            if optimizer is None:
                return build_optimizer(m, cfg.optim, only)
            return optimizer([q for q in m.parameters() if q.requires_grad and (only is None or id(q) in only)])

        b = Build(cfg, self.rt, layout, model, make_optimizer, with_extra_loss(loss, model),
                  Precision(cfg.precision.dtype, self.rt.device), SCHEMES)
        self.strategy = build_strategy(b)
        self._transform = b.batch_transform()  # what the schemes do to each micro-batch (context parallel's cut)
        self.strategy.model.train()
        self.steps_done = 0
        self._last: StepResult | None = None  # the latest step's result (its loss all-reduce may be in flight)
        self._calls: dict[str, int] = {}
        self._uid = [os.urandom(8).hex()]  # one key space per Parallel, the same on every rank (rank 0's)
        if self.rt.distributed:
            dist.broadcast_object_list(self._uid, src=0)

    # ---- what the loop uses
    @property
    def model(self) -> nn.Module:
        """The wrapped model forward runs (DDP, FSDP, TP; a pipeline rank's stages)."""
        return self.strategy.model

    @property
    def module(self) -> nn.Module:
        """The plain model: the single-process parameter names (this rank's shards or stages)."""
        return self.strategy.module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.strategy.optimizer

    @property
    def rank(self) -> int:
        return self.rt.rank

    @property
    def is_main(self) -> bool:
        return self.rt.is_main

    def batches(self, dataset, steps: int | None = None, start: int | None = None) -> Iterator[list]:
        """This rank's micro-batches for each step in [start, steps): train.global_batch_size samples per step,
        drawn by plait's seeded sampler, so the global batches do not depend on the layout.

        dataset: plait's (with `fetch`) or any map-style dataset whose items are (input, target).
        """
        t = self.cfg.train
        if not hasattr(dataset, "fetch"):
            if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
                raise ConfigError(f"p.batches: a {type(dataset).__name__} has no __len__/__getitem__; give a map-style "
                                  "dataset of (input, target) items")
            dataset = _MapData(dataset)
        start = self.steps_done if start is None else start
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ConfigError(f"p.batches(steps={steps!r}): steps counts the steps to draw from the current one; give "
                              "a positive integer (or leave it out: up to train.steps)")
        stop = t.steps if steps is None else start + steps
        if stop <= start:
            raise ConfigError(f"p.batches(): the loop is at step {start} and train.steps = {t.steps}: nothing is left "
                              "to draw; pass steps=N for N more steps, or raise train.steps")
        sampler = make_sampler(dataset, t.global_batch_size, t.seed, self.cfg.data.sampler)
        return iter(StepLoader(dataset, sampler, start, stop, self.rt.axis_rank("batch"), self.layout.dp,
                               t.micro_batch_size, pin_memory=self.rt.device.type == "cuda", transform=self._transform))

    def step(self, batch: list, max_norm: float = 0.0) -> StepResult:
        """One optimizer step on this rank's micro-batches (from `batches`); max_norm > 0 clips the global norm."""
        s = self.strategy
        if self._schedule:
            set_lr(s.optimizer, lr_at(self.steps_done, self.cfg.optim, self.cfg.train.steps, self.cfg.train.global_batch_size))
        if self._last is not None:
            self._last.wait()  # the step before's loss all-reduce: long done, this keeps one in flight at most
        micro = [(x.to(self.rt.device), y.to(self.rt.device)) for x, y in batch]
        loss = s.forward_backward(micro).detach().float().reshape(())
        norm = s.clip_grad_norm(max_norm, need_norm=True)
        norm = None if norm is None else norm.detach()
        s.optimizer_step()
        work, dp = None, 1
        if self.rt.distributed and self.layout.replicas > 1:  # each dp (and cp) rank has its share's mean: averaged when read
            loss = loss.clone()
            work, dp = dist.all_reduce(loss, group=self.rt.axis_group("dp"), async_op=True), self.layout.replicas
        self.steps_done += 1
        self._last = StepResult(loss, norm, work, dp)
        return self._last

    # ---- checkpoints: DCP, the plain model's names, any layout can load them
    def save(self, run_dir: str | Path, step: int | None = None, keep: int = 2) -> Path:
        """Write run_dir/checkpoints/step_NNNNNNN (every rank calls it: it is collective); returns the folder."""
        self._all_arrive("save")
        step = self.steps_done if step is None else step
        ckpt = Checkpointer(run_dir, self.rt, keep)
        ckpt.save(self.strategy, step, {})
        return checkpoint_dir(run_dir) / step_name(step)

    def load(self, run_dir: str | Path) -> int:
        """Load the newest checkpoint of run_dir (saved at any layout); returns its step (0: none). Collective."""
        self._all_arrive("load")
        found = [None]
        if self.rt.is_main or not self.rt.distributed:
            path = find_resumable(run_dir)
            found = [str(path) if path is not None else None]
        if self.rt.distributed:
            dist.broadcast_object_list(found, src=0)
        if found[0] is None:
            return 0
        self.steps_done = int(load_checkpoint(self.strategy, Path(found[0]))["step"])
        return self.steps_done

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole plain model's weights on every rank (gathered from shards and stages), on the CPU. Collective."""
        self._all_arrive("state_dict")
        return self.strategy.full_model_state_dict()

    def _all_arrive(self, what: str) -> None:
        """Before a collective call: every rank must make it within ARRIVAL_S, or this rank says which call is
        collective (a save under `if p.is_main:` would otherwise hang until launch.timeout_s, then die in gloo)."""
        if self._last is not None:
            self._last.wait()  # the latest step's loss all-reduce, before any other collective
        if not (self.rt.distributed and dist.is_initialized()):
            return
        self._calls[what] = n = self._calls.get(what, 0) + 1
        store = dist.distributed_c10d._get_default_store()
        key, world = f"plait/userloop/{self._uid[0]}/{what}/{n}", dist.get_world_size()
        arrived, deadline = store.add(key, 1), time.monotonic() + ARRIVAL_S
        while arrived < world:
            if time.monotonic() > deadline:
                store.add(key, -1)  # take the arrival back: a later call by every rank meets under this key again
                self._calls[what] = n - 1
                raise CollectiveError(f"p.{what} is collective: call it on every rank, not inside `if p.is_main:` "
                                      f"({arrived} of {world} ranks called it within {ARRIVAL_S:g} s)")
            time.sleep(0.005)
            arrived = store.add(key, 0)

    def close(self) -> None:
        """Leave the process group if parallelize made it (call it at the end of the script)."""
        if self._last is not None:
            self._last.wait()
        self.strategy.finish()
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # no rank leaves while another still talks to it (gloo aborts on a half-closed pair)
            if self._owns_group:
                dist.destroy_process_group()

    def __enter__(self) -> Parallel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def parallelize(model: nn.Module, config: Config | str | Path | None = None, *, loss: Callable,
                optimizer: Callable | None = None) -> Parallel:
    """Apply the configured layout to your model; the returned Parallel owns the step (see the module docstring).

    config: a Config, a TOML path, or None for the one `plait launch` passed (PLAIT_CONFIG; without a launcher,
    the defaults on one process). loss(outputs, targets) -> mean loss. optimizer: params -> torch Optimizer
    (default: optim.* of the config, with its learning-rate schedule).
    """
    try:
        return Parallel(model, resolve_config(config), loss, optimizer)
    except ConfigError as e:
        if not (os.environ.get(CONFIG_ENV) and "RANK" in os.environ):
            raise
        # under `plait launch`: one line from rank 0 and exit 2, as plait train says a bad layout (no traceback)
        if os.environ["RANK"] == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
