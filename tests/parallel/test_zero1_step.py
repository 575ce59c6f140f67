"""ZeRO-1 (plait.parallel.zero.ZeroOneStrategy) one step at a time against the single-process model.

Two ranks, each with its half of the global batch, against one process that trains the same
model on the whole batch with torch.optim.SGD and torch.nn.utils.clip_grad_norm_. After every step:
the loss (averaged over the ranks), the returned global norm, the averaged gradients of the
parameters this rank owns (clipped), and every parameter (all-gathered) must match within 1e-6.
The bookkeeping the module docstring promises is checked too: one owner per parameter, owners from
plait.comm.placement.balanced_owners, segments padded to the largest load, parameters and gradients
as views into the two flat buffers.
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
GLOBAL_BATCH = 8


def make_mlp() -> nn.Module:
    # Tensors of different sizes (192, 24, 384, 16, 64, 4), so that the owners' loads differ.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 24), nn.Tanh(), nn.Linear(24, 16), nn.Tanh(), nn.Linear(16, 4))


def make_gpt() -> nn.Module:
    from plait.models.gpt import GPT

    torch.manual_seed(0)
    return GPT(16, 8, 16, 2, 1, tie_embeddings=True)  # head.weight is tok_emb.weight: one parameter, owned once


def gpt_loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def batches(kind: str, steps: int):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        if kind == "mlp":
            yield torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)
        else:
            yield (torch.randint(0, 16, (GLOBAL_BATCH, 8), generator=g),
                   torch.randint(0, 16, (GLOBAL_BATCH, 8), generator=g))


def make_sgd(momentum: float):
    def make_optimizer(m, only=None):
        return torch.optim.SGD([p for p in m.parameters() if only is None or id(p) in only], lr=0.1, momentum=momentum)
    return make_optimizer


def zero1_run(kind: str = "mlp", steps: int = 3, max_norm: float = 0.0, need_norm: bool = True, micro: int = 1,
              momentum: float = 0.0) -> list[dict]:
    """Pool task: `steps` steps of ZeRO-1 and of the reference; per step, the differences (and raw norms)."""
    from plait.parallel.base import Precision
    from plait.parallel.zero import ZeroOneStrategy

    ref = make_mlp() if kind == "mlp" else make_gpt()
    module = copy.deepcopy(ref)
    loss_fn = F.mse_loss if kind == "mlp" else gpt_loss
    make_optimizer = make_sgd(momentum)
    ref_opt = make_optimizer(ref)
    rank, n = dist.get_rank(), dist.get_world_size()
    local = GLOBAL_BATCH // n
    strategy = ZeroOneStrategy(module, make_optimizer, loss_fn, Precision("fp32", torch.device("cpu")), local,
                               dist.group.WORLD)
    names = {id(p): name for name, p in module.named_parameters()}
    ref_params = dict(ref.named_parameters())

    records = []
    for x, y in batches(kind, steps):
        ref_opt.zero_grad()
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        # max_norm = 0 means "measure, do not clip": torch's clip_grad_norm_ with inf does exactly that
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm if max_norm > 0 else math.inf)
        ref_opt.step()

        xs, ys = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        size = local // micro
        loss = strategy.forward_backward([(xs[i:i + size], ys[i:i + size]) for i in range(0, local, size)])
        norm = strategy.clip_grad_norm(max_norm, need_norm=need_norm)
        owned_grads = {names[id(p)]: p.grad.clone() for p in strategy.owned}
        strategy.optimizer_step()

        mean_loss = loss.clone()
        dist.all_reduce(mean_loss)
        mean_loss /= n
        rec = {"loss": abs(float(mean_loss) - float(ref_loss.detach())),
               "ref_norm": float(ref_norm), "norm": None if norm is None else float(norm),
               "grads": {k: float((g - ref_params[k].grad).abs().max()) for k, g in owned_grads.items()},
               "params": {k: float((p.detach() - ref_params[k].detach()).abs().max())
                          for k, p in module.named_parameters()}}
        records.append(rec)
    return records


def _check(per_rank: list[list[dict]], max_norm: float = 0.0, need_norm: bool = True, kind: str = "mlp"):
    n_params = len(list((make_mlp() if kind == "mlp" else make_gpt()).parameters()))
    owned = [set(r[0]["grads"]) for r in per_rank]
    assert sum(map(len, owned)) == n_params  # every gradient compared by its owner, once
    for rank, records in enumerate(per_rank):
        for step, rec in enumerate(records):
            where = f"rank {rank}, step {step + 1}"
            assert rec["loss"] <= TOL, where
            if need_norm or max_norm > 0:
                assert rec["norm"] == pytest.approx(rec["ref_norm"], rel=1e-6, abs=TOL), where
            else:
                assert rec["norm"] is None, where
            bad = {k: v for k, v in {**rec["grads"], **{f"param {k}": v for k, v in rec["params"].items()}}.items()
                   if not v <= TOL}
            assert bad == {}, where
            assert len(rec["params"]) == n_params


def test_zero1_sgd_steps_match_whole_batch_reference(pool2):
    per_rank = pool2.run(zero1_run, "mlp", 3)
    _check(per_rank)
    assert per_rank[0][-1]["norm"] == per_rank[1][-1]["norm"]  # every rank returns the same global norm


def test_zero1_clipped_steps_match_clip_grad_norm_reference(pool2):
    max_norm = 0.05
    per_rank = pool2.run(zero1_run, "mlp", 3, max_norm)
    assert all(rec["ref_norm"] > 2 * max_norm for rec in per_rank[0])  # clipping did happen, every step
    _check(per_rank, max_norm)


@pytest.mark.parametrize("need_norm", [True, False])
def test_zero1_max_norm_zero_measures_without_clipping(pool2, need_norm):
    _check(pool2.run(zero1_run, "mlp", 2, 0.0, need_norm), 0.0, need_norm)


def test_zero1_accumulates_micro_batches_and_keeps_momentum_on_owners(pool2):
    _check(pool2.run(zero1_run, "mlp", 3, 0.5, True, 2, 0.9), 0.5)


def test_zero1_tied_gpt_owns_the_shared_weight_once(pool2):
    _check(pool2.run(zero1_run, "gpt", 2, 1.0), 1.0, kind="gpt")


# ---------------------------------------------------------------- bookkeeping

def bookkeeping(kind: str) -> dict:
    """Pool task: who owns what, the loads, and whether parameters / gradients view the flat buffers."""
    from plait.comm.placement import balanced_owners
    from plait.parallel.base import Precision
    from plait.parallel.zero import ZeroOneStrategy

    module = make_mlp() if kind == "mlp" else make_gpt()
    params = list(module.parameters())
    names = {id(p): name for name, p in module.named_parameters()}
    loss_fn = F.mse_loss if kind == "mlp" else gpt_loss
    s = ZeroOneStrategy(module, make_sgd(0.0), loss_fn, Precision("fp32", torch.device("cpu")), 4, dist.group.WORLD)
    expected_owner = balanced_owners([p.numel() for p in params], 2)
    loads = [sum(p.numel() for p, o in zip(params, expected_owner) if o == r) for r in range(2)]

    def views(t, buf):
        return t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()

    rank = dist.get_rank()
    lo, hi = rank * s.segment, (rank + 1) * s.segment
    base = s.flat_params.data_ptr()
    in_own_segment = [lo <= (p.data_ptr() - base) // p.element_size() and
                      (p.data_ptr() - base) // p.element_size() + p.numel() <= hi for p in s.owned]
    x, y = next(batches(kind, 1))
    s.forward_backward([(x[:4], y[:4])])
    s.optimizer_step()
    return {
        "owned": sorted(names[id(p)] for p in s.owned),
        "expected": sorted(names[id(p)] for p, o in zip(params, expected_owner) if o == rank),
        "all": sorted(names.values()),
        "loads": loads, "owned_numel": s.owned_numel, "segment": s.segment, "flat": s.flat_params.numel(),
        "optimizer_holds_owned_only": {id(p) for g in s.optimizer.param_groups for p in g["params"]}
        == set(map(id, s.owned)),
        "params_view_flat": all(views(p, s.flat_params) for p in params),
        "owned_in_own_segment": all(in_own_segment),
        "grads_view_flat_after_step": all(p.grad is not None and views(p.grad, s.flat_grads) for p in params),
        "grads_zero_after_step": float(s.flat_grads.abs().max()) == 0.0,
        "largest": max(p.numel() for p in params),
    }


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_zero1_each_parameter_has_one_owner_and_segments_balance(pool2, kind):
    r0, r1 = pool2.run(bookkeeping, kind)
    assert set(r0["owned"]).isdisjoint(r1["owned"]) and sorted(r0["owned"] + r1["owned"]) == r0["all"]
    for rank, r in enumerate((r0, r1)):
        assert r["owned"] == r["expected"], f"rank {rank}: not balanced_owners' assignment"
        assert r["owned_numel"] == r["loads"][rank]
        assert r["segment"] == max(r["loads"]) and r["flat"] == 2 * r["segment"]  # every segment padded to S
        assert r["optimizer_holds_owned_only"], rank
        assert r["params_view_flat"] and r["owned_in_own_segment"], rank
        assert r["grads_view_flat_after_step"] and r["grads_zero_after_step"], rank
    loads = r0["loads"]
    assert max(loads) - min(loads) <= r0["largest"]  # LPT: the gap is at most one tensor
    if kind == "mlp":
        assert loads == [384, 192 + 64 + 24 + 16 + 4]


def test_balanced_owners_is_largest_first_onto_the_lightest_rank():
    from plait.comm.placement import balanced_owners

    assert balanced_owners([7, 5, 4, 3, 1], 2) == [0, 1, 1, 0, 1]  # loads 10, 10
    assert balanced_owners([2, 2, 2, 2], 2) == [0, 1, 0, 1]  # ties: lowest rank, then earlier tensor
    assert balanced_owners([1, 9], 3) == [1, 0]
    assert balanced_owners([], 2) == []
