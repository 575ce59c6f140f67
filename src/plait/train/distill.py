"""Knowledge distillation (Hinton et al. 2015): `[distill] teacher = "RUN_DIR"`, `temperature`, `alpha`.

    distiller = Distiller.from_run(cfg.distill, spec, device)   # the teacher, loaded once, eval mode, no gradient
    distiller.attach(model)                                    # a forward pre-hook on the plain student
    loss_fn = distiller.loss(loss_fn)                          # alpha T^2 KL(teacher_T || student_T) + (1 - alpha) hard

The teacher runs on each rank on the same micro-batch as the student: a forward pre-hook on the plain
student module (which every wrapper, DDP or FSDP, still calls) computes the teacher's logits under
no_grad and hands them to the next loss. A pipeline's stages never call the whole student: its last
stage runs the teacher on the local batch and hands each micro-batch's loss its piece (`hand`). The
soft term is a mean over samples (tokens for a language model), like the hard loss, so the trainer's
micro-batch and data-parallel scaling hold for both.
Evaluation (the student in eval mode) gets the hard loss alone, so validation losses compare with a
student trained without a teacher.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from plait.errors import ConfigError
from plait.train.weights import load_run_model


def soft_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 * KL(softmax(teacher / T) || softmax(student / T)), averaged over the rows (samples or tokens)."""
    s = F.log_softmax(student.flatten(0, -2).float() / temperature, dim=-1)
    t = F.log_softmax(teacher.flatten(0, -2).float() / temperature, dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature ** 2


class Distiller:
    def __init__(self, teacher: nn.Module, temperature: float, alpha: float):
        self.teacher = teacher.eval().requires_grad_(False)
        self.temperature, self.alpha = temperature, alpha
        self._pending: torch.Tensor | None = None
        self.hooked = True  # a pipeline: a stage's forward is not the student's (its last stage calls `hand`)

    def __deepcopy__(self, memo) -> Distiller:
        """One teacher per process: a copy of the student (a pipeline stage) shares it, and its hook."""
        return self

    @classmethod
    def from_run(cls, dcfg, spec, device: torch.device) -> Distiller:
        _, tspec, teacher = load_run_model(Path(dcfg.teacher))
        if (tspec.task, tspec.vocab_size, tspec.num_classes) != (spec.task, spec.vocab_size, spec.num_classes):
            raise ConfigError(f"distill.teacher = {dcfg.teacher!r} predicts {tspec.task} over "
                              f"{tspec.vocab_size or tspec.num_classes} outputs, the student {spec.task} over "
                              f"{spec.vocab_size or spec.num_classes}: the teacher must be trained on the same data")
        return cls(teacher.to(device), dcfg.temperature, dcfg.alpha)

    def attach(self, student: nn.Module) -> None:
        student.register_forward_pre_hook(self._before_student)
        setattr(student, "plait_distiller", self)  # noqa: B010 (a pipeline, whose stages never call the whole student, finds it here)

    def hand(self, logits: torch.Tensor) -> None:
        """The teacher's logits for the next loss (a pipeline's last stage, which runs the teacher itself)."""
        self._pending = logits

    def _before_student(self, module: nn.Module, args) -> None:
        if module.training and torch.is_grad_enabled() and self.hooked:
            with torch.no_grad():
                self._pending = self.teacher(args[0])

    def loss(self, hard: Callable) -> Callable:
        def loss(outputs, targets):
            value = hard(outputs, targets)
            teacher, self._pending = self._pending, None
            if teacher is None:  # evaluation: the hard loss alone
                return value
            return self.alpha * soft_loss(outputs, teacher, self.temperature) + (1 - self.alpha) * value

        return loss
