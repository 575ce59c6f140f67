"""Global-norm clipping (plait.parallel.gradsync.clip_grad_norm / clip_grads) against torch.nn.utils.clip_grad_norm_.

The contract (gradsync's docstring): whatever the layout, the returned norm is the one
torch.nn.utils.clip_grad_norm_ returns on the single-process model, and every gradient is scaled
by the same factor. Each scenario computes the reference's gradients, then for three max_norms
checks the returned norm and every clipped gradient (full tensors):

    below   max_norm = 0.3 x the norm: clipping happens
    above   max_norm = 3 x the norm: nothing changes
    zero    max_norm = 0: the norm is returned and nothing is clipped

Scenarios: (a) plain replicated gradients, (b) tensor-parallel DTensor gradients (apply_tp, with
and without sequence parallel), (c) FSDP2 DTensor gradients (apply_fsdp, stage 3), (d) `partial`
pieces summed over a group (each rank holds half of the parameters; one rank holding none),
(e) `clip_also` copies, clipped but not counted.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

TOL = 1e-6
CASES = {"below": 0.3, "above": 3.0, "zero": 0.0}  # max_norm as a multiple of the reference's norm
V, T, W, HEADS, B = 16, 8, 16, 2, 4


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 24), nn.Tanh(), nn.Linear(24, 16), nn.Tanh(), nn.Linear(16, 4))


def mlp_grads(model: nn.Module) -> None:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
    F.mse_loss(model(x), y).backward()


def make_gpt() -> nn.Module:
    from plait.models.gpt import GPT

    torch.manual_seed(0)
    return GPT(V, T, W, HEADS, 2, tie_embeddings=True)


def gpt_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def gpt_loss(model, x, y):
    return F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1))


def reference(grads: list[torch.Tensor], max_norm: float) -> tuple[float, list[torch.Tensor]]:
    """torch's answer on the single-process gradients: (norm, clipped gradients); max_norm 0 measures only."""
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
    return float(norm), [p.grad for p in params]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def compare(ref_grads: list[torch.Tensor], run, pick: list[int] | None = None) -> dict:
    """For each case: run(max_norm) clips this layout's gradients and returns (norm, the full clipped values of the
    tensors it holds); those are ref_grads[i] for i in `pick` (default: all of them, in order). The reference's
    norm is always that of all of ref_grads. -> {case: {"norm": |diff|, "grads": max |diff|, ...}}."""
    pick = list(range(len(ref_grads))) if pick is None else pick
    ref_norm = reference(ref_grads, math.inf)[0]
    out = {}
    for case, factor in CASES.items():
        max_norm = factor * ref_norm
        want_norm, want = reference(ref_grads, max_norm)
        norm, got = run(max_norm)
        assert len(got) == len(pick)
        out[case] = {"norm": abs(float(norm) - want_norm), "ref_norm": want_norm,
                     "grads": max((float((_full(g) - want[i]).abs().max()) for g, i in zip(got, pick)), default=0.0),
                     "changed": max(float((w - r).abs().max()) for w, r in zip(want, ref_grads))}
    return out


def _restoring(params: list[nn.Parameter], clip):
    """run(max_norm) for `compare`: put the saved gradients back, clip, return (norm, gradients)."""
    saved = [p.grad.detach().clone() for p in params]

    def run(max_norm):
        for p, s in zip(params, saved):
            p.grad = s.clone()
        norm = clip(max_norm)
        return norm, [p.grad for p in params]
    return run


def _assert_ok(result: dict, where: str = "") -> None:
    assert set(result) == set(CASES), where
    for case, r in result.items():
        assert r["norm"] <= 1e-6 * max(1.0, r["ref_norm"]), f"{where} {case}: norm off by {r['norm']}"
        assert r["grads"] <= TOL, f"{where} {case}: clipped gradients off by {r['grads']}"
    assert result["below"]["changed"] > 1e-4 and result["above"]["changed"] == 0.0  # the cases mean what they say
    assert result["zero"]["changed"] == 0.0


# ---------------------------------------------------------------- (a) plain replicated gradients, one process

def test_plain_gradients_match_clip_grad_norm_():
    from plait.parallel.gradsync import clip_grad_norm, clip_grads

    model = make_mlp()
    mlp_grads(model)
    params = list(model.parameters())
    ref_grads = [p.grad.clone() for p in params]
    _assert_ok(compare(ref_grads, _restoring(params, lambda m: clip_grad_norm(params, m))), "clip_grad_norm")
    _assert_ok(compare(ref_grads, _restoring(params, lambda m: clip_grads([p.grad for p in params], m))), "clip_grads")
    # a parameter without a gradient is skipped, not an error; nothing at all has norm 0
    frozen = nn.Parameter(torch.ones(3))
    _assert_ok(compare(ref_grads, _restoring(params, lambda m: clip_grad_norm([*params, frozen], m))), "+ no grad")
    assert float(clip_grads([], 1.0)) == 0.0


def test_plain_gradients_with_clip_also_copy_not_counted():
    """(e) in one process: a copy of the first weight's gradient (a tied weight held twice) is clipped, not counted."""
    from plait.parallel.gradsync import clip_grad_norm

    model = make_mlp()
    mlp_grads(model)
    params = list(model.parameters())
    ref_grads = [p.grad.clone() for p in params]
    copy_ = nn.Parameter(params[0].detach().clone())
    copy_.grad = params[0].grad.clone()

    def run(max_norm):
        for p, g in zip(params, ref_grads):
            p.grad = g.clone()
        copy_.grad = ref_grads[0].clone()
        norm = clip_grad_norm(params, max_norm, clip_also=[copy_])
        return norm, [p.grad for p in params] + [copy_.grad]

    _assert_ok(compare(ref_grads, run, pick=[*range(len(params)), 0]), "clip_also")


# ---------------------------------------------------------------- on two ranks

def tp_task(sp: bool, align: bool) -> dict:
    """(b) Pool task: the tiny GPT's gradients under apply_tp (DTensors) against the reference's."""
    from torch.distributed.device_mesh import init_device_mesh

    from plait.parallel.gradsync import align_grads, clip_grad_norm
    from plait.parallel.tp import apply_tp

    ref = make_gpt()
    tp = apply_tp(copy.deepcopy(ref), init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), sp)
    x, y = gpt_batch()
    gpt_loss(ref, x, y).backward()
    gpt_loss(tp, x, y).backward()
    if align:  # what every strategy does after backward (Strategy.after_backward)
        align_grads(tp.parameters())
    params = list(tp.parameters())
    placements = sorted({str(p.grad.placements) for p in params if hasattr(p.grad, "placements")})
    ref_grads = [dict(ref.named_parameters())[n].grad for n, _ in tp.named_parameters()]
    return {"placements": placements,
            "result": compare(ref_grads, _restoring(params, lambda m: clip_grad_norm(params, m)))}


@pytest.mark.parametrize("align", [True, False], ids=["aligned", "as-backward-left-them"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_tensor_parallel_dtensor_gradients(pool2, sp, align):
    for rank, r in enumerate(pool2.run(tp_task, sp, align)):
        assert "(Shard(dim=0),)" in r["placements"] and "(Shard(dim=1),)" in r["placements"]  # DTensors were counted
        if sp and not align:
            assert "(Partial(sum),)" in r["placements"]  # sequence-parallel LayerNorms: partial sums until aligned
        _assert_ok(r["result"], f"rank {rank}")


def fsdp_task() -> dict:
    """(c) Pool task: FSDP2 (stage 3) on each rank's half of the batch; gradients are the averaged Shard(0) pieces."""
    from torch.distributed.device_mesh import init_device_mesh

    from plait.parallel.fsdp import apply_fsdp
    from plait.parallel.gradsync import clip_grad_norm

    ref = make_gpt()
    model = apply_fsdp(copy.deepcopy(ref), init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)), stage=3)
    x, y = gpt_batch()
    gpt_loss(ref, x, y).backward()
    rank, half = dist.get_rank(), B // 2
    gpt_loss(model, x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]).backward()
    params = list(model.parameters())
    placements = sorted({str(p.grad.placements) for p in params})
    ref_grads = [dict(ref.named_parameters())[n].grad for n, _ in model.named_parameters()]
    return {"placements": placements, "tied": model.head.weight is model.tok_emb.weight,
            "result": compare(ref_grads, _restoring(params, lambda m: clip_grad_norm(params, m)))}


def test_fsdp2_dtensor_gradients(pool2):
    for rank, r in enumerate(pool2.run(fsdp_task)):
        assert r["placements"] == ["(Shard(dim=0),)"] and r["tied"], rank
        _assert_ok(r["result"], f"rank {rank}")


def partial_task(split: str) -> dict:
    """(d) Pool task: each rank holds some of the MLP's parameters (`partial`, squares summed over the group).

    split: "halves" (every other tensor), "weights" (biases replicated and counted once as `whole`, weights
    split), "one-holds-all" (rank 1 holds nothing but still joins the sum), "with-copy" (halves, and rank 1
    also holds a copy of rank 0's first weight in `clip_also`, as a pipeline's tied weight)."""
    from plait.parallel.gradsync import clip_grad_norm

    rank = dist.get_rank()
    model = make_mlp()
    mlp_grads(model)  # the same full gradients on both ranks: the pieces are what a rank keeps of them
    params = list(model.parameters())
    ref_grads = [p.grad.clone() for p in params]
    whole: list = []
    if split == "weights":
        whole = [p for p in params if p.dim() == 1]
        mine = [i for i, p in enumerate(params) if p.dim() == 2][rank::2]
    elif split == "one-holds-all":
        mine = list(range(len(params))) if rank == 0 else []
    else:
        mine = list(range(len(params)))[rank::2]
    held = [params[i] for i in mine]
    also = []
    if split == "with-copy" and rank == 1:
        c = nn.Parameter(params[0].detach().clone())
        c.grad = ref_grads[0].clone()
        also = [c]
    ids = [id(p) for p in params]
    pick = [ids.index(id(p)) for p in whole + held] + [0] * len(also)  # the copy is of params[0]
    errors: dict[str, str] = {}

    def clip(max_norm):
        try:
            return clip_grad_norm(whole, max_norm, partial=held, group=dist.group.WORLD, clip_also=also)
        except RuntimeError as e:  # reported, not raised: the other rank has already finished this case's sum
            errors[f"max_norm={max_norm:.4g}"] = str(e).splitlines()[0]
            return torch.tensor(float("nan"))

    # a rank holding nothing still joins each case's sum and gets the global norm back
    return {"held": mine, "result": compare(ref_grads, _restoring(whole + held + also, clip), pick), "errors": errors}


@pytest.mark.parametrize("split", ["halves", "weights", "with-copy"])
def test_partial_pieces_summed_over_the_group(pool2, split):
    r0, r1 = pool2.run(partial_task, split)
    n = len(list(make_mlp().parameters()))
    if split in ("halves", "with-copy"):
        assert sorted(r0["held"] + r1["held"]) == list(range(n))
    for rank, r in enumerate((r0, r1)):
        assert r["errors"] == {}, rank
        _assert_ok(r["result"], f"rank {rank}")


def test_a_rank_holding_nothing_joins_the_sum_and_clips_nothing(pool2):
    r0, r1 = pool2.run(partial_task, "one-holds-all")
    assert r1["held"] == []
    for rank, r in enumerate((r0, r1)):
        assert r["errors"] == {}, rank
        _assert_ok(r["result"], f"rank {rank}")
