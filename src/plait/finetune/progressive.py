"""Progressive freezing (FreezeOut, Brock et al. 2017; AutoFreeze, Liu et al. 2021): blocks freeze front to back.

    plan = ProgressiveFreeze(model, steps=T, start=0.5)   # block i of L freezes after step freeze_steps(L, T, 0.5)[i]
    newly = plan.advance(done)                           # before each step: the parameters frozen now (often none)

The schedule is linear from t0 = start * T: block i (of L) is frozen once floor(t0 + i (T - t0) / L) steps
are done, so block 0 freezes at t0 and the last block a (T - t0) / L steps before the end. The input
embeddings (every nn.Embedding directly on the model) freeze with block 0, except a token embedding
tied to the output head, which keeps training through the head. Once blocks 0..k are frozen, a forward
hook detaches block k's output: backward stops there, so the frozen front costs its forward alone and
the step time falls as the blocks freeze. Frozen parameters get requires_grad = False; the trainer
(plait.train.progressive) drops their optimizer state and rebuilds the gradient synchronisation.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch
import torch.nn as nn

from plait.errors import ConfigError


def freeze_steps(layers: int, steps: int, start: float) -> list[int]:
    """Steps done after which each block is frozen: floor(t0 + i * (T - t0) / L), t0 = start * T (exact arithmetic)."""
    t0 = Fraction(repr(float(start))) * steps
    return [math.floor(t0 + Fraction(i) * (steps - t0) / layers) for i in range(layers)]


def blocks_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of the model's repeated blocks in order (`model.blocks`, a ModuleList or ModuleDict)."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleDict):
        return [(f"blocks.{k}", m) for k, m in blocks.items()]
    if isinstance(blocks, nn.ModuleList):
        return [(f"blocks.{i}", m) for i, m in enumerate(blocks)]
    return []


def check(cfg, model: nn.Module | None = None) -> None:
    """finetune.progressive_freeze against the model: it freezes model.blocks (the keys' own rules are
    plait.finetune.keys', the layouts plait.finetune.check_layout's)."""
    if cfg.finetune.progressive_freeze and model is not None and not blocks_of(model):
        raise ConfigError(f"finetune.progressive_freeze freezes model.blocks front to back, and model "
                          f"{cfg.model.factory or cfg.model.name!r} has no `blocks` (a ModuleList or ModuleDict); use "
                          "finetune.freeze patterns instead")


def _detach(module: nn.Module, args, output):
    """Backward stops at the latest frozen block's output. It stays a tensor that takes a gradient (a leaf), so a
    pipeline stage ending there still receives its output's gradient from the next stage, as its schedule expects."""
    out = output.detach()
    return out.requires_grad_() if output.requires_grad and torch.is_grad_enabled() else out


class ProgressiveFreeze:
    """Which blocks are frozen after how many steps, and the freezing itself (requires_grad, the detach hook)."""

    def __init__(self, model: nn.Module, steps: int, start: float, whole: nn.Module | None = None):
        """whole: the plain model when `model` holds part of it (a pipeline rank's stages, blocks keyed by their index
        in the whole model): the schedule and the tied weights are the whole model's, each rank freezing what it holds."""
        self.blocks = blocks_of(model)
        self.count = len(blocks_of(whole)) if whole is not None else len(self.blocks)
        # global block index -> (name, block) held here
        self.held = {int(name.rsplit(".", 1)[1]) if whole is not None else i: (name, block)
                     for i, (name, block) in enumerate(self.blocks)}
        self.at = freeze_steps(self.count, steps, start)
        # a model's tied weights (plait.models.protocols.TiedModel; finetune sits beside models, so asked by name)
        owner = whole if whole is not None else model
        tied = set(owner.tied_parameters().values()) if callable(getattr(owner, "tied_parameters", None)) else set()
        self.front = [(f"{name}.{pname}", p) for name, child in model.named_children() if isinstance(child, nn.Embedding)
                      for pname, p in child.named_parameters() if f"{name}.{pname}" not in tied]
        self.frozen = 0
        self._hook = None

    def due(self, done: int) -> int:
        """How many blocks are frozen once `done` steps are done."""
        return sum(1 for s in self.at if s <= done)

    def advance(self, done: int) -> list[tuple[str, nn.Parameter]]:
        """Freeze the blocks due after `done` steps; returns the (name, parameter) newly frozen (trainable before)."""
        want = self.due(done)
        newly: list[tuple[str, nn.Parameter]] = []
        while self.frozen < want:
            i = self.frozen
            held = self.held.get(i)  # None: block i is on another pipeline rank
            params = [(f"{held[0]}.{n}", p) for n, p in held[1].named_parameters()] if held else []
            if i == 0:
                params = self.front + params
            for n, p in params:
                if p.requires_grad:
                    p.requires_grad_(False)
                    newly.append((n, p))
            self.frozen += 1
        last = max((i for i in self.held if i < want), default=None)  # the latest frozen block held here
        if last is not None and (self._hook is None or self._hooked != last):
            if self._hook is not None:
                self._hook.remove()
            self._hook = self.held[last][1].register_forward_hook(_detach)  # backward stops at its output
            self._hooked = last
        return newly

    def names(self, count: int) -> list[str]:
        prefix = self.blocks[0][0].rsplit(".", 1)[0] if self.blocks else "blocks"
        return [self.held[i][0] if i in self.held else f"{prefix}.{i}" for i in range(count)]
