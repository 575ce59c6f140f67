"""parallel.pp_split = "auto": pipeline stages balanced by measured block time and each rank's speed (HetPipe).

The default split balances parameter counts, which is right when every block costs the same and every pipeline
rank is equally fast. On unequal devices (or blocks) the slowest stage sets the pace of the whole pipeline, so
"auto" measures instead: before training, every pipeline rank times the forward and backward of each block (the
first block with what comes before the blocks, the last with what comes after: embeddings, head) on one
micro-batch of the job's shape, the median of a few repeats, a slow-device fault included (plait.faults scales
it as it scales training). The times are all-gathered, and the split minimises the largest stage time where stage
s costs the sum of its blocks' times *measured on the rank that holds stage s*. Every rank computes the same split
from the same table. The split changes only where blocks run, never the trajectory.

Measured on plait's GPT (its input is a batch of token ids); other models take explicit cut points.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import cast

import torch
import torch.distributed as dist
import torch.nn as nn

from plait.errors import ConfigError
from plait.faults import slow_compute
from plait.models.protocols import blocks_module, pipeline_parts
from plait.parallel.split import min_max_bounds, pipeline_stage

REPEATS = 3


def heterogeneous_bounds(costs: list[list[float]], stages: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) block ranges, stage s on rank s, minimising the largest stage time, where
    costs[s][i] is block i's time on the rank of stage s (plait.parallel.split.min_max_bounds)."""
    return min_max_bounds(costs, stages)


def block_times(module: nn.Module, n_blocks: int, micro: int, context: int, vocab: int, device, rank: int) -> list[float]:
    """This rank's forward + backward seconds of each block (first and last with their extras), one micro-batch."""
    model = copy.deepcopy(module)
    if any(p.is_meta for p in model.parameters()):  # shard-only initialisation: values do not matter for timing
        model = model.to_empty(device=device)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)
    bounds = [(i, i + 1) for i in range(n_blocks)]
    parts = [pipeline_stage(model, bounds, s).to(device).train() for s in range(n_blocks)]
    del model
    x = torch.randint(0, vocab, (micro, context), device=device)
    times = []
    for part in parts:
        runs = []
        for _ in range(REPEATS + 1):  # the first run allocates: left out
            inp = x if x.dtype == torch.long else x.detach().requires_grad_(True)
            t0 = time.perf_counter()
            out = part(inp)
            t1 = time.perf_counter()
            out.backward(torch.ones_like(out) / out.numel())
            compute = t1 - t0 + time.perf_counter() - t1
            runs.append(compute + slow_compute(rank, compute))
        times.append(statistics.median(runs[1:]))
        x = out.detach()
        part.zero_grad(set_to_none=True)
    return times


def auto_bounds(module: nn.Module, stages: int, cfg, rt) -> tuple[list[tuple[int, int]], list[list[float]]]:
    """(the split, times[stage][block], the slowest replica's of each pipeline rank) for pp_split = auto."""

    if cfg.model.name != "gpt" or cfg.model.factory:
        raise ConfigError("parallel.pp_split = 'auto' times plait's GPT blocks; for your own model give the cut "
                          "points (parallel.pp_split = [i, ...]) or leave it empty (balanced by parameters)")
    if cfg.parallel.virtual_stages > 1:
        raise ConfigError("parallel.pp_split = 'auto' places one stage per pipeline rank; with "
                          f"parallel.virtual_stages = {cfg.parallel.virtual_stages} give the cut points")
    n = len(list(blocks_module(module, pipeline_parts(module) or {}).children()))
    vocab = cast(nn.Embedding, module.tok_emb).num_embeddings
    times = block_times(module, n, cfg.train.micro_batch_size, cfg.model.context, vocab, rt.device, rt.rank)
    mine = torch.tensor([float(rt.axis_rank("pp")), *times], dtype=torch.float64, device=rt.device)
    # over every rank, not the pipeline's group: the data-parallel replicas must cut the model alike (their
    # gradients are averaged tensor by tensor), so each stage's cost is the slowest of its replicas
    table = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(table, mine)
    costs = [[0.0] * n for _ in range(stages)]
    for row in table:
        s = int(row[0])
        costs[s] = [max(a, float(b)) for a, b in zip(costs[s], row[1:])]
    return heterogeneous_bounds(costs, stages), costs
