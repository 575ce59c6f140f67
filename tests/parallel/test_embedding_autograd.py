"""Sharded embedding tables' autograd (plait.parallel.embedding) against a single-process nn.Embedding reference.

The convention under test (the module's docstring): backward *averages over ranks*, like the dense
gradients. Each rank's loss L_r is the mean over its own samples, and data parallelism trains the
global-batch mean L = (1/n) sum_r L_r; the dense part gets dL/dθ by all-reducing dL_r/dθ and
dividing by n. A table row used by samples of several ranks receives, through the all-gather in
_ReduceScatterBatch.backward, every rank's dL_r/d(row), and divides their sum by n: the table's
gradient is then dL/d(table), the reference's, on the same footing as the dense gradients. So:

* _ReduceScatterBatch alone: forward = this rank's slice of the ranks' summed partials; backward =
  (1/n) x the true gradient of sum_r <G_r, out_r> (the all-gathered upstream gradients, divided by n).
* ShardedEmbeddings ("table" and "row") under a small dense head: outputs equal the reference's rows
  of this rank's samples; every table row's gradient (on the rank that holds it) and the dense
  gradients (all-reduced and averaged) equal the reference's gradients of the global-mean loss.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

TOL = 1e-6
CARDS = [3, 17, 6, 40, 2]  # uneven row counts: row shards of ceil(rows / 2) and the rest
DIM = 5
GLOBAL_BATCH = 8


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))


def reduce_scatter_check() -> dict:
    """Pool task: _ReduceScatterBatch on known partials and upstream gradients, against torch autograd."""
    from plait.parallel.embedding import _ReduceScatterBatch

    rank, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    partials = [torch.randn(4, 3, DIM, generator=g) for _ in range(n)]  # every rank's (B, fields, dim) partial sums
    upstream = [torch.randn(4 // n, 3, DIM, generator=g) for _ in range(n)]  # each rank's gradient of its slice

    # reference: one process holding all the partials
    ref = [p.clone().requires_grad_() for p in partials]
    total = sum(ref)
    slices = total.chunk(n, 0)
    sum(((s * u).sum() for s, u in zip(slices, upstream)), torch.zeros(())).backward()

    mine = partials[rank].clone().requires_grad_()
    out = _ReduceScatterBatch.apply(mine, dist.group.WORLD, n)
    out.backward(upstream[rank])
    return {"out": float((out - slices[rank]).abs().max()),
            # the true gradient of the summed objective is cat(upstream); the convention divides it by n
            "grad": float((mine.grad - ref[rank].grad / n).abs().max()),
            "grad_is_mean_of_gathered": float((mine.grad - torch.cat(upstream) / n).abs().max()),
            "grad_vs_undivided": float((mine.grad - ref[rank].grad).abs().max())}


def test_reduce_scatter_batch_forward_slice_and_averaged_backward(pool2):
    for rank, r in enumerate(pool2.run(reduce_scatter_check)):
        assert r["out"] <= TOL and r["grad"] <= TOL and r["grad_is_mean_of_gathered"] <= TOL, (rank, r)
        assert r["grad_vs_undivided"] > 1e-2, "the backward is meant to average over ranks, not to sum"


def sharded_check(mode: str, cards: list[int] = CARDS) -> dict:
    """Pool task: EmbeddingCollection + Linear head, sharded tables vs the reference on the whole batch."""
    from plait.models.deepfm import EmbeddingCollection
    from plait.parallel.embedding import ShardedEmbeddings
    from plait.parallel.gradsync import allreduce_grads

    rank, n = dist.get_rank(), dist.get_world_size()
    local = GLOBAL_BATCH // n
    torch.manual_seed(0)
    ref_emb = EmbeddingCollection(cards, DIM)
    ref_head = nn.Linear(len(cards) * DIM, 1)
    emb = ShardedEmbeddings(copy.deepcopy(ref_emb), mode, _mesh())
    head = copy.deepcopy(ref_head)

    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randint(0, c, (GLOBAL_BATCH,), generator=g) for c in cards], 1)
    target = torch.randn(GLOBAL_BATCH, 1, generator=g)
    mine = slice(rank * local, (rank + 1) * local)

    ref_out = ref_emb(ids)
    ref_loss = ((ref_head(ref_out.flatten(1)) - target) ** 2).mean()  # the global-batch mean
    ref_loss.backward()

    out = emb(ids[mine])
    res: dict = {"out": float((out - ref_out[mine]).abs().max()), "owned": list(emb.owned),
                 "requires_grad": out.requires_grad, "rows": {}, "placements": {}, "loss": 0.0}
    everyone = torch.tensor([int(out.requires_grad)])
    dist.all_reduce(everyone, op=dist.ReduceOp.MIN)
    if not everyone.item():  # some rank's backward would skip the collective it owes the others: stop, not hang
        return res
    loss = ((head(out.flatten(1)) - target[mine]) ** 2).mean()  # this rank's mean
    loss.backward()
    allreduce_grads(list(head.parameters()), dist.group.WORLD, n)  # the dense part: averaged over ranks
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    res["loss"] = abs(float(mean_loss / n) - float(ref_loss.detach()))
    res["dense"] = {name: float((p.grad - dict(ref_head.named_parameters())[name].grad).abs().max())
                    for name, p in head.named_parameters()}
    chunk = [-(-c // n) for c in cards]
    for key, table in emb.tables.items():
        i = int(key)
        want = ref_emb.tables[key].weight.grad
        w, grad = table.weight, table.weight.grad
        if hasattr(w, "to_local"):  # row mode: rows [rank * c, rank * c + local rows)
            res["placements"][i] = (str(w.placements), None if grad is None else str(grad.placements))
            lo, held = rank * chunk[i], w.to_local().shape[0]
            want = want[lo:lo + held]
            grad = None if grad is None else grad.to_local()
        else:
            lo = 0
        if grad is None:
            grad = torch.zeros_like(want)  # no gradient at all: fine only if the reference's is zero (or empty)
        # one entry per table row held here: (global row, max abs diff)
        res["rows"][i] = [(lo + r, float((grad[r] - want[r]).abs().max())) for r in range(want.shape[0])]
    return res


@pytest.mark.parametrize("mode", ["table", "row"])
def test_sharded_embeddings_outputs_and_every_row_gradient_match(pool2, mode):
    from plait.comm.placement import balanced_owners

    r0, r1 = pool2.run(sharded_check, mode)
    for rank, r in enumerate((r0, r1)):
        assert r["requires_grad"], rank
        assert r["out"] <= TOL and r["loss"] <= TOL, (rank, r["out"], r["loss"])
        assert all(v <= TOL for v in r["dense"].values()), (rank, r["dense"])
        bad = {(i, row): d for i, rows in r["rows"].items() for row, d in rows if not d <= TOL}
        assert bad == {}, f"rank {rank}: (table, row) -> max abs diff"
    # every row of every table checked exactly once, on the rank that holds it
    held = sorted((i, row) for r in (r0, r1) for i, rows in r["rows"].items() for row, _ in rows)
    assert held == [(i, row) for i, c in enumerate(CARDS) for row in range(c)]
    if mode == "table":
        owner = balanced_owners([c * DIM for c in CARDS], 2)
        assert [r0["owned"], r1["owned"]] == [[i for i, o in enumerate(owner) if o == k] for k in range(2)]
    else:
        for r in (r0, r1):
            assert set(r["placements"]) == set(range(len(CARDS)))
            assert all(p == ("(Shard(dim=0),)", "(Shard(dim=0),)") for p in r["placements"].values()), r["placements"]


def test_a_rank_without_tables_still_joins_the_backward_collective(pool2):
    # One table, two ranks: balanced_owners puts it on rank 0 and rank 1 holds nothing (dp > fields in a config).
    r0, r1 = pool2.run(sharded_check, "table", [5])
    assert r0["owned"] == [0] and r1["owned"] == []
    assert r0["out"] <= TOL and r1["out"] <= TOL  # the forward is right
    # ...but the backward is a collective every rank must enter: its output has to carry a grad_fn
    assert r0["requires_grad"] and r1["requires_grad"]
