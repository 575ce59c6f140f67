"""Meta-learning (train.objective = "meta"): a model learns an initialisation that adapts to a new task in a few steps.

    learner = MetaLearner(base, ways=3, shots=5, queries=5, algorithm="reptile", inner_steps=5, inner_lr=0.1)
    logits = learner(episodes)   # (batch, ways * (shots + queries), *input) -> (batch, ways * queries, ways)

For each episode (plait.data.episodes) the learner copies the base model's parameters theta, takes `inner_steps`
plain SGD steps at `inner_lr` on the support rows' cross-entropy (phi, the adapted parameters), and classifies the
query rows with phi. Evaluation does the same on held-out classes: its accuracy is the accuracy after K shots.

Training turns the episodes into a gradient on theta that every layout averages like any other:

* first-order MAML (Finn et al. 2017): the query loss at phi, differentiated as if phi were theta (the query
  logits are computed at theta - theta.detach() + phi, which is phi in value and has the identity as its Jacobian):
  the gradient is grad L_query(phi).
* Reptile (Nichol et al. 2018): the gradient is theta - phi, so that SGD at optim.lr = epsilon moves theta
  epsilon of the way to phi. It enters the loss through `extra_loss` as <theta, (theta - phi).detach()> minus its
  own value (zero in value), and the logged loss is the query loss at phi.

Both are means over the micro-batch's episodes, so micro-batches, gradient accumulation and dp (each rank adapts
to its own episodes; DDP or ZeRO averages the outer gradient) give one process's update. The inner loop runs on
detached copies through torch.func.functional_call: it never touches theta's gradients nor a data-parallel
wrapper's hooks. With ZeRO-3 the learner is one FSDP unit (no `blocks`): theta is whole inside its forward.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

ALGORITHMS = ("reptile", "fomaml")


class MetaLearner(nn.Module):
    def __init__(self, base: nn.Module, ways: int, shots: int, queries: int, algorithm: str = "reptile",
                 inner_steps: int = 5, inner_lr: float = 0.1):
        super().__init__()
        if algorithm not in ALGORITHMS:
            raise ValueError(f"meta-learning algorithm {algorithm!r}: choose one of {', '.join(ALGORITHMS)}")
        self.base = base
        self.ways, self.shots, self.queries = ways, shots, queries
        self.algorithm, self.inner_steps, self.inner_lr = algorithm, inner_steps, inner_lr
        self._pull: torch.Tensor | None = None

    def adapt(self, params: dict[str, torch.Tensor], support: torch.Tensor) -> dict[str, torch.Tensor]:
        """inner_steps of plain SGD at inner_lr on the support rows' cross-entropy, from `params`: new tensors, detached."""
        labels = torch.arange(self.ways, device=support.device).repeat_interleave(self.shots)
        fast = {n: p.detach() for n, p in params.items()}
        with torch.enable_grad():  # evaluation adapts too
            for _ in range(self.inner_steps):
                leaves = {n: t.detach().requires_grad_() for n, t in fast.items()}
                loss = F.cross_entropy(functional_call(self.base, leaves, (support,)).float(), labels)
                grads = torch.autograd.grad(loss, list(leaves.values()))
                fast = {n: (t - self.inner_lr * g).detach() for (n, t), g in zip(leaves.items(), grads)}
        return fast

    def forward(self, episodes: torch.Tensor) -> torch.Tensor:
        s = self.ways * self.shots
        theta = dict(self.base.named_parameters())
        training = self.training and torch.is_grad_enabled()
        outs, pulls = [], []
        for episode in episodes:
            fast = self.adapt(theta, episode[:s])
            if training and self.algorithm == "fomaml":  # phi in value, the identity to theta in backward
                at = {n: theta[n] - theta[n].detach() + fast[n] for n in theta}
                outs.append(functional_call(self.base, at, (episode[s:],)))
                continue
            with torch.no_grad():
                outs.append(functional_call(self.base, fast, (episode[s:],)))
            if training:  # Reptile: d/dtheta of <theta, (theta - phi).detach()> is theta - phi
                pulls.append(sum((theta[n] * (theta[n].detach() - fast[n])).sum() for n in theta))
        out = torch.stack(outs)
        self._pull = None
        if pulls:
            pull = torch.stack(pulls).mean()
            self._pull = pull - pull.detach()
            out = out + 0.0 * self._pull  # the outputs stay on theta's graph (FSDP hooks its backward there)
        return out

    def extra_loss(self) -> torch.Tensor | None:
        """Reptile's outer gradient, zero in value (plait.train.loss.with_extra_loss adds it to the micro-batch loss)."""
        pull, self._pull = self._pull, None
        return pull


@torch.no_grad()
def episode_accuracy(learner: MetaLearner, dataset, episodes: int, batch: int = 16) -> float:
    """Query accuracy after adapting to each of the first `episodes` episodes of `dataset`, in one process."""
    was = learner.training
    learner.eval()
    right = total = 0
    for lo in range(0, min(episodes, len(dataset)), batch):
        x, y = dataset.fetch(torch.arange(lo, min(lo + batch, episodes, len(dataset))))
        right += int((learner(x).argmax(-1) == y).sum())
        total += y.numel()
    learner.train(was)
    return right / max(total, 1)
