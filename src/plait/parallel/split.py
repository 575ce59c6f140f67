"""Cut a model into pipeline stages by its blocks: used by pipeline training and pipeline serving.

A model that can be cut exposes `pipeline_parts()` -> {"blocks": attribute name of an
nn.ModuleDict of blocks keyed "0".."L-1", "first": [modules only the first stage keeps],
"last": [modules only the last stage keeps]}; its forward must skip parts that are None
(see plait.models.decoder.Decoder.forward). An nn.Sequential needs nothing: its children are the blocks
(plait.models.protocols). A stage keeps the plain model's parameter names.
"""

from __future__ import annotations

import copy

import torch.nn as nn

from plait.errors import ConfigError
from plait.models.hf_plans import as_hf_stage
from plait.models.protocols import blocks_module, pipeline_parts


def balanced_bounds(sizes: list[int], stages: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) block ranges, one per stage, minimising the largest stage's total size.

    Every stage gets at least one block. Ties go to the earlier cut (the first stage also holds
    the embeddings in a GPT, so it should not take more blocks).
    """
    return min_max_bounds([list(sizes)] * stages, stages)


def min_max_bounds(costs: list[list[float]], stages: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) block ranges, stage s costing the sum of costs[s][i] over its blocks, minimising the
    largest stage's cost. Every stage gets at least one block; ties go to the earlier cut."""
    n = len(costs[0]) if costs else 0
    if not 1 <= stages <= n or len(costs) != stages:
        raise ConfigError(f"cannot cut {n} blocks into {stages} pipeline stages; set parallel.pp between 1 and {n}")
    prefix = []
    for row in costs:
        pre = [0.0]
        for c in row:
            pre.append(pre[-1] + c)
        prefix.append(pre)
    inf = float("inf")
    # best[k][i]: the smallest possible largest stage cost with the first i blocks on stages 0..k-1
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        pre = prefix[k - 1]
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], pre[i] - pre[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds, i = [], n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        bounds.append((j, i))
        i = j
    return bounds[::-1]


def bounds_from_split(split: list[int], n_blocks: int) -> list[tuple[int, int]]:
    """Stage ranges from user cut points: pp_split = [3, 6] on 8 blocks -> [(0, 3), (3, 6), (6, 8)]."""
    points = [0, *split, n_blocks]
    if any(b <= a for a, b in zip(points, points[1:])):
        raise ConfigError(
            f"parallel.pp_split = {split} must be increasing block indices strictly between 0 and {n_blocks}; "
            f"e.g. [{n_blocks // 2}] for 2 stages"
        )
    return list(zip(points, points[1:]))


def stage_bounds(model: nn.Module, stages: int, split: list[int] | None = None) -> list[tuple[int, int]]:
    """Block ranges per stage: the user's split if given, else balanced by parameter count."""
    parts = pipeline_parts(model) or {}  # a model the pipeline check let through has its parts
    blocks = dict(blocks_module(model, parts).named_children())
    if split:
        if len(split) != stages - 1:
            raise ConfigError(f"parallel.pp_split = {split} gives {len(split) + 1} stages but parallel.pp = {stages}; "
                              f"give {stages - 1} cut points")
        return bounds_from_split(list(split), len(blocks))
    # Embeddings count towards the first block and the head towards the last (tied weights once).
    seen: set[int] = set()

    def size(modules) -> int:
        total = 0
        for m in modules:
            for p in (m.parameters() if m is not None else []):
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel()
        return total

    sizes = [size([b]) for b in blocks.values()]
    sizes[0] += size(_part(model, n) for n in parts["first"])
    sizes[-1] += size(_part(model, n) for n in parts["last"])
    return balanced_bounds(sizes, stages)


def pipeline_stage(model: nn.Module, bounds: list[tuple[int, int]], stage: int) -> nn.Module:
    """A copy of `model` holding only stage `stage`'s blocks (plus embeddings first, head last)."""
    parts = pipeline_parts(model)
    if parts is None:
        raise ConfigError(f"{type(model).__name__} cannot be split into pipeline stages: it is no nn.Sequential and has "
                          "no pipeline_parts() (docs/models.md)")
    start, stop = bounds[stage]
    part = copy.deepcopy(model)
    blocks = blocks_module(part, parts)
    for i, name in enumerate(list(blocks._modules)):  # by position; the kept blocks keep their names
        if not start <= i < stop:
            del blocks._modules[name]
    embeds = parts.get("embeds_input", False)  # a transformers model: its own forward runs on every stage
    if stage != 0:
        for name in parts["first"]:
            _replace(part, name, None)
    if stage != len(bounds) - 1:
        for name in parts["last"]:
            _replace(part, name, nn.Identity() if embeds else None)
    if embeds:
        as_hf_stage(part)
    return part


def _part(model: nn.Module, name: str) -> nn.Module | None:
    """A first/last part by name: a module, or a parameter of the model's own (DeepFM's bias) held in a module."""
    path, _, leaf = name.rpartition(".")
    owner = model.get_submodule(path) if path else model
    if leaf in owner._parameters:
        holder = nn.Module()
        holder.register_parameter("p", owner._parameters[leaf])
        return holder
    return getattr(owner, leaf)


def _replace(model: nn.Module, name: str, value: nn.Module | None) -> None:
    path, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(path) if path else model, leaf, value)
