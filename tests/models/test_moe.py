"""The MoE layer's maths in one process (plait.models.moe) against token-by-token references.

Routing (top-k, gates), capacity (counted per sequence, first choices first, earlier tokens first),
the dropped-assignment counts, the load-balancing loss against Switch's formula, every gradient
against autograd through the reference, and the GPT's MoE blocks and hooks.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from plait.config import load_config
from plait.data.spec import DataSpec
from plait.errors import ConfigError
from plait.models import build_model, check_config, expert_counts
from plait.models.moe import MoE, expert_major, window_stats
from plait.train.loss import lm_loss, with_extra_loss

WIDTH, HIDDEN, E = 6, 10, 4


def layer(top_k: int = 1, capacity_factor: float = 0.0, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    m = MoE(WIDTH, HIDDEN, E, top_k, capacity_factor)
    with torch.no_grad():  # non-zero biases and a sharper router, so that every term shows in the comparisons
        m.router.weight.normal_(0, 1.0)
        m.b1.normal_(0, 0.1)
        m.b2.normal_(0, 0.1)
    return m


def reference(m: MoE, x: torch.Tensor) -> tuple[torch.Tensor, list[list[bool]]]:
    """Token by token: y_t = sum over its kept choices of gate * expert(x_t); capacity per sequence, choice-major."""
    out = torch.zeros_like(x)
    kept_all = []
    for b in range(x.shape[0]):
        probs = torch.softmax(x[b] @ m.router.weight.T, -1)
        top_p, top_i = probs.topk(m.top_k, -1)
        gates = top_p if m.top_k == 1 else top_p / top_p.sum(-1, keepdim=True)
        cap = m.capacity(x.shape[1]) if m.training else 0
        load = [0] * m.experts
        kept = [[True] * m.top_k for _ in range(x.shape[1])]
        if cap:
            for j in range(m.top_k):  # first choices claim slots before second choices
                for t in range(x.shape[1]):
                    e = int(top_i[t, j])
                    kept[t][j] = load[e] < cap
                    load[e] += 1
        for t in range(x.shape[1]):
            for j in range(m.top_k):
                if kept[t][j]:
                    e = int(top_i[t, j])
                    h = F.gelu(x[b, t] @ m.w1[e] + m.b1[e])
                    out[b, t] = out[b, t] + gates[t, j] * (h @ m.w2[e] + m.b2[e])
        kept_all.append(kept)
    return out, kept_all


@pytest.mark.parametrize("top_k, cf", [(1, 0.0), (2, 0.0), (1, 1.0), (2, 0.75)], ids=["top1", "top2", "top1-cap1", "top2-cap0.75"])
def test_outputs_and_every_gradient_match_the_token_by_token_reference(top_k, cf):
    m = layer(top_k, cf)
    x = torch.randn(3, 7, WIDTH, generator=torch.Generator().manual_seed(1))
    upstream = torch.randn(3, 7, WIDTH, generator=torch.Generator().manual_seed(2))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = m(xa)
    (got * upstream).sum().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    want, kept = reference(m, xb)
    (want * upstream).sum().backward()
    assert (got - want).abs().max() < 1e-6
    assert (xa.grad - xb.grad).abs().max() < 1e-6
    for n, p in m.named_parameters():
        assert (grads[n] - p.grad).abs().max() < 1e-6, n
    dropped = sum(not k for seq in kept for tok in seq for k in tok)
    assert m.stats[E] == dropped and m.stats[E + 1] == 3 * 7 * top_k
    assert m.stats[:E].sum() == 3 * 7 * top_k - dropped
    if cf:
        assert dropped > 0, "the capacity case must drop something to test it"


def test_top1_gate_is_the_router_probability_and_top2_gates_sum_to_one():
    m = layer(2)
    x = torch.randn(5, WIDTH)
    probs, top_i, gates, keep = m.route(x, 5)
    assert keep is None  # dropless
    assert torch.equal(top_i, probs.topk(2, -1).indices)
    assert torch.allclose(gates.sum(-1), torch.ones(5))
    m1 = layer(1)
    probs, top_i, gates, _ = m1.route(x, 5)
    assert torch.allclose(gates[:, 0], probs.max(-1).values)


def test_capacity_is_per_sequence_first_choices_first_earlier_tokens_first():
    m = layer(2, capacity_factor=1.0)
    with torch.no_grad():  # every token: first choice expert 0, second choice expert 1
        m.router.weight.zero_()
        m.router.weight[0, 0], m.router.weight[1, 0] = 3.0, 2.0
    x = torch.zeros(2, 8, WIDTH)
    x[..., 0] = 1.0
    cap = m.capacity(8)
    assert cap == math.ceil(1.0 * 8 * 2 / E) == 4
    _, top_i, _, keep = m.route(x.reshape(-1, WIDTH), 8)
    assert (top_i[:, 0] == 0).all() and (top_i[:, 1] == 1).all()
    keep = keep.view(2, 8, 2)
    # In each sequence the first 4 tokens get expert 0 and expert 1; the last 4 are dropped from both.
    assert keep[:, :4].all() and not keep[:, 4:].any()
    # Per sequence, not per batch: the second sequence has its own slots.
    m(x)
    assert m.stats[0] == 2 * cap and m.stats[1] == 2 * cap and m.stats[E] == 2 * 2 * 4


def test_capacity_makes_the_output_of_a_batch_that_of_its_sequences_alone():
    m = layer(2, capacity_factor=0.5)
    x = torch.randn(4, 9, WIDTH)
    whole = m(x)
    apart = torch.cat([m(x[i:i + 1]) for i in range(4)])
    assert (whole - apart).abs().max() < 1e-6


def test_evaluation_is_dropless_and_adds_no_loss():
    m = layer(1, capacity_factor=0.25)
    x = torch.randn(2, 8, WIDTH)
    m.eval()
    assert m.route(x.reshape(-1, WIDTH), 8)[3] is None
    m(x)
    assert m.aux_loss is None and m.stats is None
    m.train()
    dropless = layer(1)
    dropless.eval()
    m.eval()
    assert torch.allclose(m(x), dropless(x))


def switch_loss(probs: torch.Tensor) -> torch.Tensor:
    """Switch Transformer eq. 4 for one group of T tokens, top-1: E * sum_i f_i P_i."""
    t, e = probs.shape
    f = torch.stack([(probs.argmax(-1) == i).float().sum() / t for i in range(e)])
    p = probs.sum(0) / t
    return e * (f * p).sum()


def test_load_balancing_loss_is_switch_eq_4_averaged_over_sequences():
    m = layer(1)
    x = torch.randn(3, 10, WIDTH)
    m(x)
    probs = torch.softmax(x @ m.router.weight.T, -1)
    want = torch.stack([switch_loss(probs[b]) for b in range(3)]).mean()
    assert torch.allclose(m.aux_loss, want, atol=1e-6)
    # top-k: f counts all k choices (Megatron's convention), so a uniform load still gives 1
    m2 = layer(2)
    with torch.no_grad():
        m2.router.weight.zero_()
    m2(x)
    assert torch.allclose(m2.aux_loss, torch.tensor(1.0))
    # the gradient reaches the router through P (f is a count)
    m.router.weight.grad = None
    m(x)
    m.aux_loss.backward()
    assert m.router.weight.grad.abs().sum() > 0


def test_window_stats_sum_reset_and_dropped_share():
    m = layer(1, capacity_factor=0.5)
    x = torch.randn(2, 8, WIDTH)
    m(x)
    m(x)
    out = window_stats([m], lambda t: t * 2, ranks=2, steps=2)  # as if a second rank saw the same
    kept = sum(out["moe_tokens_per_expert"][0])
    assert kept == 2 * 2 * 16 * (1 - out["moe_dropped"]) / 2  # two ranks x two forwards of 16 tokens, over two steps
    assert 0 < out["moe_dropped"] < 1 and "moe_a2a_bytes" not in out  # no expert parallel: no all-to-all
    assert m.stats is None


def test_expert_major_permutation():
    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])  # source 0 sends 2, 0, 1 rows to local experts 0..2; source 1: 1, 3, 0
    arrived = torch.arange(7)  # source 0: e0 e0 e2 | source 1: e0 e1 e1 e1
    perm = expert_major(counts)
    assert arrived[perm].tolist() == [0, 1, 3, 4, 5, 6, 2]


def gpt(*overrides: str):
    cfg = load_config(None, ["model.layers=4", "model.width=16", "model.heads=2", "model.context=8", *overrides])
    return cfg, build_model(cfg.model, DataSpec(name="t", task="lm", vocab_size=11, tokens_per_sample=8))


def test_gpt_moe_blocks_parameter_count_and_loss_hook():
    dense_cfg, dense = gpt()
    cfg, model = gpt("model.moe_experts=4", "model.moe_every=2", "model.moe_aux_weight=0.1")
    moe_blocks = [n for n, b in model.blocks.items() if isinstance(b.mlp, MoE)]
    assert moe_blocks == ["1", "3"] and expert_counts(cfg.model) == [4, 4]
    h = 16
    expert = 4 * (h * 4 * h + 4 * h + 4 * h * h + h)  # E x (up + its bias + down + its bias)
    dense_mlp = h * 4 * h + 4 * h + 4 * h * h + h
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(model) - count(dense) == 2 * (expert + h * 4 - dense_mlp)  # + the router, - the dense MLP
    model.train()
    x, y = torch.randint(0, 11, (2, 8)), torch.randint(0, 11, (2, 8))
    loss = with_extra_loss(lm_loss, model)
    logits = model(x)
    aux = sum(model.blocks[n].mlp.aux_loss for n in moe_blocks)
    assert torch.allclose(loss(logits, y), lm_loss(logits, y) + 0.1 * aux)
    model.eval()
    logits = model(x)
    assert torch.equal(loss(logits, y), lm_loss(logits, y))  # evaluation: the task loss alone
    assert with_extra_loss(lm_loss, torch.nn.Linear(2, 2)) is lm_loss


@pytest.mark.parametrize("overrides, message", [
    (("model.moe_experts=4", "model.moe_top_k=5"), "model.moe_top_k = 5 must be between 1 and model.moe_experts = 4"),
    (("model.moe_experts=4", "model.moe_every=5"), "model.moe_every = 5 must be between 1 and model.layers = 4"),
    (("model.moe_experts=4", "model.moe_capacity_factor=-1.0"), "model.moe_capacity_factor = -1.0 must be"),
    (("model.name='mlp'", "model.moe_experts=4"), "model.moe_experts = 4 makes the gpt's blocks"),
])
def test_moe_keys_are_checked_by_the_model_registry(overrides, message):
    cfg = load_config(None, ["model.layers=4", *overrides])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_config(cfg.model, "digits" if cfg.model.name == "mlp" else "stdlib-text")
