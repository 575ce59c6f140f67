"""Strategy wrappers in isolation: central DP around a fake inner strategy, norm bounds around a fake combine, the aggregators."""

import math

import numpy as np
import pytest
import torch

from fed_helpers import coordinator, fed_config, template, update
from plait.federated.privacy import epsilon
from plait.federated.strategies import (
    ClientUpdate,
    DPFixedClipping,
    FedAvg,
    NormBounded,
    PrivacyPolicy,
    RoundPlan,
    Strategy,
    build_strategy,
)
from plait.federated.tensors import clip, flatten, norm


class FakeInner(Strategy):
    """An inner strategy that records what a wrapper hands it; its step adds the delta, its bounds halve client 0's update."""

    name = "fake"

    def __init__(self):
        self.plans, self.bounded, self.steps = [], [], []

    def configure_round(self, rnd, available, rng, poisson=False):
        self.plans.append(poisson)
        return RoundPlan(rnd, list(available), {"mode": "local", "lr": 0.1})

    def bound(self, updates):
        self.bounded.append([u.client_id for u in updates])
        return [ClientUpdate(u.client_id, u.num_samples, {k: v / 2 for k, v in u.delta.items()}) if u.client_id == 0 else u
                for u in updates]

    def aggregate(self, rnd, weights, updates):
        raise AssertionError("under DP the inner combine must not see the updates")

    def step(self, rnd, weights, delta):
        self.steps.append(delta)
        return {k: w + delta[k] for k, w in weights.items()}


def dp_wrapper(z=1.5, s=0.5, seed=7):
    """DP around FakeInner with q N = 0.5 * 4 = 2 expected clients."""
    inner = FakeInner()
    policy = PrivacyPolicy(noise_multiplier=z, clip_norm=s, sample_rate=0.5, total_clients=4, delta=1e-5,
                           generator=torch.Generator().manual_seed(seed))
    return DPFixedClipping(inner, policy), inner


def test_shared_clip_scales_to_the_bound_and_says_so():
    big = update(0, 1, 3.0)  # nine values of 3: norm 9
    clipped, hit = clip(big.delta, 0.5)
    assert hit and norm(clipped) == pytest.approx(0.5) and float(clipped["w"][0, 0]) == pytest.approx(3.0 * 0.5 / 9)
    same, hit = clip(big.delta, 9.5)
    assert not hit and same is big.delta
    inf = {"w": torch.full((2, 3), math.inf), "b": torch.zeros(3)}
    assert clip(inf, 1.0) == (inf, False)  # nothing to scale by; the server rejects such an update


def test_dp_wrapper_noises_the_sum_of_clipped_updates_and_steps_with_it():
    # Prepare: S = 0.5, z = 1.5, q N = 2. After the inner's bounds, client 0 is 1.5 everywhere (norm 4.5), client 1 is
    # 0.1 (norm 0.3, under S), client 2 is -1 (norm 3). Clipped: 1.5 * 0.5 / 4.5 = 1/6, 0.1, -1 * 0.5 / 3 = -1/6.
    wrapper, inner = dp_wrapper()
    updates = [update(0, 10, 3.0), update(1, 20, 0.1), update(2, 30, -1.0)]
    # Execute
    new = wrapper.aggregate(1, template(), updates)
    # Assert: (sum of clipped + N(0, (z S)^2)) / (q N), the noise drawn from the same generator, std z S / (q N) = 0.375.
    noise = torch.randn(9, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    expected = (1 / 6 + 0.1 - 1 / 6 + 1.5 * 0.5 * noise) / 2
    assert inner.bounded == [[0, 1, 2]]
    assert torch.allclose(flatten(inner.steps[0]), expected, atol=1e-6)
    assert torch.allclose(flatten(inner.steps[0]) - 0.1 / 2, 0.375 * noise, atol=1e-6)
    assert torch.equal(flatten(new), flatten(inner.steps[0]))  # the inner's step made the new weights
    assert wrapper.policy.rounds == 1 and wrapper.epsilon() == pytest.approx(epsilon(0.5, 1.5, 1, 1e-5)[0])


def test_dp_wrapper_clips_each_update_to_the_bound():
    # Prepare: no noise, so the inner receives (sum of clipped updates) / (q N) alone.
    wrapper, inner = dp_wrapper(z=0.0)
    # Execute: one oversize update (norm 3 * 3 = 9), then two in opposite directions.
    wrapper.aggregate(1, template(), [update(1, 1, 3.0)])
    wrapper.aggregate(2, template(), [update(1, 1, 3.0), update(2, 1, -30.0)])
    # Assert
    assert norm(inner.steps[0]) == pytest.approx(0.5 / 2)
    assert float(inner.steps[0]["b"][0]) == pytest.approx(0.5 / 3 / 2)
    assert norm(inner.steps[1]) == pytest.approx(0.0, abs=1e-7)  # both clipped to 0.5: they cancel


def test_dp_wrapper_samples_by_poisson_and_tells_clients_to_clip():
    wrapper, inner = dp_wrapper()
    plan = wrapper.configure_round(3, [0, 1, 2], np.random.default_rng(0))
    assert inner.plans == [True]
    assert plan.round == 3 and plan.clients == [0, 1, 2]
    assert plan.instructions == {"mode": "local", "lr": 0.1, "clip_norm": 0.5, "unweighted": True}
    assert wrapper.name == "fake"


def test_dp_wrapper_noises_a_masked_sum():
    # Prepare: secure aggregation hands over the sum of 3 client-clipped updates; its weight (3 clients) is not used.
    wrapper, inner = dp_wrapper(seed=11)
    total = torch.arange(9, dtype=torch.float64) / 10
    # Execute
    wrapper.aggregate_sum(1, template(), total, 3.0)
    # Assert
    noise = torch.randn(9, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    assert torch.allclose(flatten(inner.steps[0]), (total + 0.75 * noise) / 2, atol=1e-6)
    assert wrapper.epsilon() == pytest.approx(epsilon(0.5, 1.5, 1, 1e-5)[0])


def test_norm_bounds_scale_an_oversize_update_before_the_combine_sees_it():
    # Prepare: a combine that records what it is given.
    seen = []
    combine = NormBounded(lambda ups: seen.append(ups) or ups[0].delta, clip_norm=1.0)
    # Execute
    combine([update(4, 1, 2.0), update(5, 1, 0.1)])  # norms 6 and 0.3
    # Assert: 2 * 1 / 6 = 1/3 everywhere; the small one as it was.
    assert combine.clipped == [4]
    assert norm(seen[0][0].delta) == pytest.approx(1.0)
    assert torch.allclose(flatten(seen[0][0].delta), torch.full((9,), 1 / 3, dtype=torch.float64))
    assert torch.equal(flatten(seen[0][1].delta), flatten(update(5, 1, 0.1).delta))


def test_norm_bound_relative_to_the_median():
    # Norms 3, 6 and 300: the median is 6, so with norm_bound 2 the limit is 12 and only the last is scaled.
    combine = NormBounded(lambda ups: ups[2].delta, norm_bound=2.0)
    out = combine([update(0, 1, 1.0), update(1, 1, 2.0), update(2, 1, 100.0)])
    assert combine.clipped == [2]
    assert torch.allclose(flatten(out), torch.full((9,), 4.0, dtype=torch.float64))


def test_median_of_three_updates_coordinate_wise():
    # Prepare: per coordinate the middle value comes from a different client.
    fed = fed_config("federated.aggregator='median'", "federated.norm_bound=0").federated
    a = torch.tensor([1.0, 5.0, -2.0, 0.0, 7.0, 3.0, 1.0, 9.0, -4.0])
    b = torch.tensor([2.0, 4.0, -1.0, 8.0, 6.0, 3.0, -5.0, 0.0, -3.0])
    c = torch.tensor([3.0, 6.0, -3.0, 4.0, 5.0, 3.0, 2.0, 1.0, -6.0])
    # Execute
    new = build_strategy(fed).aggregate(1, template(), [update(0, 1, a), update(1, 100, b), update(2, 1, c)])
    # Assert: sample counts do not matter.
    assert flatten(new).tolist() == [2.0, 5.0, -2.0, 4.0, 6.0, 3.0, 1.0, 1.0, -4.0]


def test_trimmed_mean_against_a_hand_computation():
    # 5 updates, trim 0.2: per coordinate drop the largest and the smallest value, average the other 3.
    fed = fed_config("federated.aggregator='trimmed_mean'", "federated.trim_fraction=0.2", "federated.norm_bound=0").federated
    cols = [[1.0, 2.0, 3.0, 4.0, 100.0], [-50.0, 0.0, 1.0, 2.0, 3.0], [5.0, 5.0, 5.0, 5.0, 5.0],
            [9.0, 1.0, 8.0, 2.0, 7.0], [0.5, -0.5, 1.5, -1.5, 0.0], [10.0, 20.0, 30.0, 40.0, 50.0],
            [3.0, 1.0, 2.0, 1e6, -1e6], [0.0] * 5, [1.0, 1.0, 2.0, 2.0, 3.0]]
    ups = [update(i, 1 + i, torch.tensor([col[i] for col in cols])) for i in range(5)]
    new = build_strategy(fed).aggregate(1, template(), ups)
    hand = [3.0, 1.0, 5.0, 17 / 3, 0.0, 30.0, 2.0, 0.0, 5 / 3]  # e.g. (2 + 3 + 4) / 3, (7 + 8 + 2) / 3, (1 + 2 + 2) / 3
    assert torch.allclose(flatten(new), torch.tensor(hand, dtype=torch.float64), atol=1e-6)


def test_build_strategy_composes_what_the_config_asks_for():
    plain = build_strategy(fed_config("federated.norm_bound=0").federated)
    bounded = build_strategy(fed_config("federated.clip_norm=0.3").federated)
    private = build_strategy(fed_config("federated.dp_noise_multiplier=1.1", "federated.dp_clip_norm=0.7",
                                        "federated.clients_per_round=0.5").federated)
    assert isinstance(plain, FedAvg) and not isinstance(plain.combine, NormBounded)
    assert isinstance(bounded.combine, NormBounded) and (bounded.combine.clip_norm, bounded.combine.norm_bound) == (0.3, 3.0)
    assert isinstance(private, DPFixedClipping) and isinstance(private.inner, FedAvg) and private.name == "fedavg"
    assert (private.policy.z, private.policy.clip_norm, private.policy.expected_clients) == (1.1, 0.7, 5.0)
    assert plain.epsilon() is None and private.epsilon() == 0.0


def test_coordinator_reports_what_the_strategy_clipped_and_spent():
    # Prepare: DP over 3 clients sampled with probability 1, server clip 1.0 before the DP clip 0.5.
    coord = coordinator("federated.clients=3", "federated.min_clients=1", "federated.clip_norm=1.0", "federated.norm_bound=0",
                        "federated.dp_noise_multiplier=1.0", "federated.dp_clip_norm=0.5")
    plan = coord.open_round([0, 1, 2])
    # Execute
    for cid, value in ((0, 3.0), (1, 0.01), (2, 0.5)):  # norms 9, 0.03 and 1.5
        assert coord.submit(cid, 1, update(cid, 5, value).delta, {"num_samples": 5})[0]
    record = coord.close_round()
    # Assert
    assert plan.instructions["clip_norm"] == 0.5 and plan.instructions["unweighted"]
    assert record["clipped"] == [0, 2] and record["clients"] == 3
    assert record["epsilon"] == pytest.approx(epsilon(1.0, 1.0, 1, 1e-5)[0])


def test_secure_aggregation_asks_clients_to_clip_unless_dp_already_does():
    secure = coordinator("federated.clients=3", "federated.secure_aggregation=true", "federated.clip_norm=0.2")
    both = coordinator("federated.clients=3", "federated.secure_aggregation=true", "federated.clip_norm=0.2",
                       "federated.dp_noise_multiplier=1.0", "federated.dp_clip_norm=0.5")
    for coord in (secure, both):
        for cid in range(3):
            coord.register(cid, 32)  # 2^5: in the subgroup G generates
    assert secure.open_round([0, 1, 2]).instructions["clip_norm"] == 0.2
    assert both.open_round([0, 1, 2]).instructions["clip_norm"] == 0.5
