"""Few-shot episodes for meta-learning (train.objective = "meta"): N-way K-shot tasks over a classification source.

    bundle = episodic(build_data(cfg.data, cfg.model), cfg.data, seed, adapt)

The last data.holdout_classes classes of the source are held out. A training episode draws data.ways of the other
classes and, from each, data.shots support and data.queries query samples of the source's training split; a
validation episode does the same over the held-out classes, from both splits (no held-out sample is ever trained
on). One episode is one sample of the bundle:

    x  (ways * (shots + queries), *input)   support rows first, class by class, then the query rows the same way
    y  (ways * queries,)                     the query rows' labels 0..ways-1 (the support's are implied by order)

Episode i is drawn from (seed, i) alone (the validation episodes from a fixed seed), so the batch of step s is the
same episodes whatever the layout, and a resume draws them again: meta-learning stays layout-independent.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from plait.data.sampler import labels_of
from plait.data.spec import DataBundle
from plait.errors import DataError
from plait.runtime import mix_seed

VAL_EPISODES = 4096  # held-out episodes to evaluate on (train.eval_samples takes the first of them)


class Episodes:
    """`count` episodes of `ways` classes (each from `classes`) over `sources`: (dataset, labels) pairs."""

    def __init__(self, sources: list, classes: list[int], ways: int, shots: int, queries: int, count: int, seed: int):
        self.sources, self.ways, self.shots, self.queries = sources, ways, shots, queries
        self.count, self.seed, self.classes = count, seed, classes
        # every sample of each class, as (source number, index in it), in a fixed order
        self.members = {c: [(s, int(i)) for s, (_, labels) in enumerate(sources)
                            for i in torch.nonzero(labels == c).flatten().tolist()] for c in classes}

    def __len__(self) -> int:
        return self.count

    def draw(self, index: int) -> list[list[tuple[int, int]]]:
        """Episode `index`: for each of its classes, in label order, the shots + queries samples it takes."""
        rng = np.random.default_rng(mix_seed(self.seed, index, 0xE915))
        chosen = rng.permutation(len(self.classes))[:self.ways]
        out = []
        for c in chosen:
            pool = self.members[self.classes[int(c)]]
            out.append([pool[int(k)] for k in rng.permutation(len(pool))[:self.shots + self.queries]])
        return out

    def fetch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xs = []
        for index in idx.tolist():
            picks = self.draw(int(index))
            rows = [p[k] for p in picks for k in range(self.shots)] + [p[self.shots + k] for p in picks
                                                                          for k in range(self.queries)]
            xs.append(self._samples(rows))
        y = torch.arange(self.ways).repeat_interleave(self.queries)
        return torch.stack(xs), y.expand(len(xs), -1).clone()

    def _samples(self, rows: list[tuple[int, int]]) -> torch.Tensor:
        x = torch.empty(0)
        for s, (dataset, _) in enumerate(self.sources):
            mine = [k for k, (src, _) in enumerate(rows) if src == s]
            if not mine:
                continue
            got, _ = dataset.fetch(torch.tensor([rows[k][1] for k in mine], dtype=torch.long))
            if x.numel() == 0:
                x = torch.empty(len(rows), *got.shape[1:], dtype=got.dtype)
            x[mine] = got
        return x


def episodic(bundle: DataBundle, data_cfg, seed: int, adapt: dict) -> DataBundle:
    """The bundle as few-shot episodes (module docstring); `adapt` (algorithm, inner steps and lr) goes in the spec,
    which the model builder reads (plait.models.fewshot)."""
    spec = bundle.spec
    if spec.task != "classification":
        raise DataError(f"train.objective = 'meta' draws N-way K-shot episodes from a classification source; "
                        f"data.name = {data_cfg.name!r} is a {spec.task!r} task: use digits, images or another "
                        "classification source")
    ways, shots, queries, held = data_cfg.ways, data_cfg.shots, data_cfg.queries, data_cfg.holdout_classes
    train_classes = list(range(spec.num_classes - held))
    if len(train_classes) < ways:
        raise DataError(f"data.ways = {ways} needs that many training classes; this source has {spec.num_classes} "
                        f"classes and data.holdout_classes = {held} of them are held out: lower data.ways or "
                        "data.holdout_classes")
    train = (bundle.train, labels_of(bundle.train))
    both = [train, (bundle.val, labels_of(bundle.val))]
    need = shots + queries
    for name, sources, classes in (("training", [train], train_classes),
                                   ("held-out", both, list(range(len(train_classes), spec.num_classes)))):
        for c in classes:
            have = sum(int((labels == c).sum()) for _, labels in sources)
            if have < need:
                raise DataError(f"{name} class {c} has {have} samples; an episode takes data.shots + data.queries = "
                                f"{need} of each class: lower data.shots or data.queries")
    episode = {"ways": ways, "shots": shots, "queries": queries, "input_shape": list(spec.input_shape), **adapt}
    new_spec = replace(spec, name=f"{spec.name}-episodes", task="fewshot", num_classes=ways,
                       input_shape=[ways * need, *spec.input_shape], episode=episode)
    return DataBundle(Episodes([train], train_classes, ways, shots, queries, data_cfg.episodes, seed),
                      Episodes(both, list(range(len(train_classes), spec.num_classes)), ways, shots, queries,
                               VAL_EPISODES, 0), new_spec, stats=bundle.stats)
