"""Strategies (FedAvg, FedProx, FedAdam, FedSGD): configure_round plans and aggregate numbers against hand computations."""

import numpy as np
import pytest
import torch

from fed_helpers import fed_config, template, update
from plait.federated.client import local_update
from plait.federated.strategies import FedAdam, build_strategy, select_clients
from plait.federated.tensors import flatten


def test_fedavg_is_the_sample_weighted_mean_of_the_deltas():
    # Prepare: three clients with 10, 30 and 60 samples and deltas 1, 2 and -1 everywhere.
    fed = fed_config("federated.strategy='fedavg'").federated
    strategy = build_strategy(fed)
    start = {k: v + 0.5 for k, v in template().items()}
    # Execute
    new = strategy.aggregate(1, start, [update(0, 10, 1.0), update(1, 30, 2.0), update(2, 60, -1.0)])
    # Assert: 0.5 + (10 * 1 + 30 * 2 + 60 * -1) / 100 = 0.6
    for v in new.values():
        assert torch.allclose(v, torch.full_like(v, 0.6), atol=1e-7)


def test_fedavg_with_per_coordinate_deltas_and_server_lr():
    fed = fed_config("federated.server_lr=0.5").federated
    a, b = torch.arange(9.0), torch.arange(9.0).flip(0) * 2
    new = build_strategy(fed).aggregate(3, template(), [update(0, 1, a), update(1, 3, b)])
    expected = 0.5 * (1 * a + 3 * b) / 4
    assert torch.allclose(flatten(new).float(), expected, atol=1e-6)


def test_no_updates_leaves_the_weights_alone():
    fed = fed_config().federated
    start = template()
    assert build_strategy(fed).aggregate(1, start, []) is start


def test_fedadam_step_matches_reddi_algorithm_2_by_hand():
    fed = fed_config("federated.strategy='fedadam'", "federated.server_lr=0.1", "federated.server_betas=[0.5, 0.75]",
                     "federated.server_tau=0.01").federated
    s = build_strategy(fed)
    assert isinstance(s, FedAdam)
    w1 = s.aggregate(1, template(), [update(0, 1, 2.0)])
    # m = 0.5 * 2 = 1; v = 0.25 * 4 = 1; step = 0.1 * 1 / (1 + 0.01)
    assert torch.allclose(w1["w"], torch.full((2, 3), 0.1 / 1.01))
    w2 = s.aggregate(2, w1, [update(0, 1, -2.0)])
    # m = 0.5 * 1 + 0.5 * -2 = -0.5; v = 0.75 * 1 + 0.25 * 4 = 1.75
    assert torch.allclose(w2["b"], torch.full((3,), 0.1 / 1.01 + 0.1 * -0.5 / (1.75 ** 0.5 + 0.01)))


def test_plans_carry_each_strategys_instructions():
    rng = np.random.default_rng(0)
    plans = {name: build_strategy(fed_config(f"federated.strategy='{name}'", "federated.mu=0.3").federated)
             .configure_round(1, list(range(10)), rng).instructions for name in ("fedavg", "fedprox", "fedsgd", "fedadam")}
    assert plans["fedprox"]["mu"] == 0.3 and plans["fedavg"]["mu"] == 0.0
    assert plans["fedsgd"]["mode"] == "gradient" and plans["fedavg"]["mode"] == "local"
    assert plans["fedavg"]["epochs"] == 2 and plans["fedavg"]["batch_size"] == 16


@pytest.mark.parametrize("per_round, expected", [(1.0, 10), (0.3, 3), (4.0, 4), (0.01, 1)])
def test_client_sampling_fraction_or_count(per_round, expected):
    got = select_clients(list(range(10)), per_round, 10, np.random.default_rng(1))
    assert len(got) == expected and len(set(got)) == expected and set(got) <= set(range(10))


def test_poisson_sampling_rate():
    rng = np.random.default_rng(2)
    sizes = [len(select_clients(list(range(100)), 0.2, 100, rng, poisson=True)) for _ in range(200)]
    assert abs(np.mean(sizes) - 20) < 1.0 and np.std(sizes) > 2  # Binomial(100, 0.2): mean 20, std 4


def _tiny_problem():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(40, 4), torch.randint(0, 3, (40,))

    class DS:
        def fetch(self, idx):
            return x[idx], y[idx]

    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return model, DS(), weights, x, y


def test_fedsgd_client_returns_minus_lr_times_the_full_batch_gradient():
    model, ds, weights, x, y = _tiny_problem()
    ins = build_strategy(fed_config("federated.strategy='fedsgd'", "federated.local_lr=0.7").federated) \
        .configure_round(1, [0], np.random.default_rng(0)).instructions
    delta, loss = local_update(model, weights, ds, np.arange(40), ins, torch.nn.functional.cross_entropy, seed=0)
    ref = torch.nn.Linear(4, 3)
    ref.load_state_dict(weights)
    ref_loss = torch.nn.functional.cross_entropy(ref(x), y)
    ref_loss.backward()
    assert abs(loss - float(ref_loss.detach())) < 1e-6
    assert torch.allclose(delta["weight"], -0.7 * ref.weight.grad, atol=1e-6)
    assert torch.allclose(delta["bias"], -0.7 * ref.bias.grad, atol=1e-6)


def test_fedprox_term_keeps_the_local_model_closer_to_the_global_one():
    model, ds, weights, _, _ = _tiny_problem()
    base = {"mode": "local", "epochs": 5, "batch_size": 8, "lr": 0.5, "momentum": 0.0}
    free, _ = local_update(model, weights, ds, np.arange(40), {**base, "mu": 0.0}, torch.nn.functional.cross_entropy, 3)
    prox, _ = local_update(model, weights, ds, np.arange(40), {**base, "mu": 1.0}, torch.nn.functional.cross_entropy, 3)
    assert float(flatten(prox).norm()) < 0.9 * float(flatten(free).norm())
    # the same seed and mu = 0 reproduce the same local trajectory exactly
    again, _ = local_update(model, weights, ds, np.arange(40), {**base, "mu": 0.0}, torch.nn.functional.cross_entropy, 3)
    assert torch.equal(flatten(again), flatten(free))
