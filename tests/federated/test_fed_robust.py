"""Hostile and malformed updates: rejected with a reason or bounded; the server (coordinator and HTTP app) never crashes."""

import math

import pytest
import torch

from fed_helpers import coordinator, template, update
from plait.federated.strategies import ClientUpdate
from plait.federated.strategies.combine import median, trimmed_mean, weighted_mean
from plait.federated.strategies.robust import bound_norms
from plait.federated.tensors import encode, flatten
from plait.federated.validate import check_update


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda: ClientUpdate(0, 5, {"w": torch.full((2, 3), math.nan), "b": torch.zeros(3)}), "NaN or Inf"),
        (lambda: ClientUpdate(0, 5, {"w": torch.zeros(2, 3), "b": torch.tensor([0.0, math.inf, 0.0])}), "NaN or Inf"),
        (lambda: ClientUpdate(0, 5, {"w": torch.zeros(3, 2), "b": torch.zeros(3)}), "has shape (3, 2)"),
        (lambda: ClientUpdate(0, 5, {"w": torch.zeros(2, 3)}), "missing ['b']"),
        (lambda: ClientUpdate(0, 5, {"w": torch.zeros(2, 3), "b": torch.zeros(3), "x": torch.zeros(1)}), "unexpected ['x']"),
        (lambda: ClientUpdate(0, 5, {"w": "not a tensor", "b": torch.zeros(3)}), "w is a str, not a tensor"),
        (lambda: ClientUpdate(0, 5, {"w": torch.zeros(2, 3, dtype=torch.long), "b": torch.zeros(3)}), "floating-point"),
        (lambda: ClientUpdate(0, 0, {"w": torch.zeros(2, 3), "b": torch.zeros(3)}), "num_samples 0"),
        (lambda: ClientUpdate(0, "7", {"w": torch.zeros(2, 3), "b": torch.zeros(3)}), "num_samples '7'"),
        (lambda: ClientUpdate(0, 10**12, {"w": torch.zeros(2, 3), "b": torch.zeros(3)}), "num_samples"),
    ],
)
def test_malformed_updates_are_named_and_rejected(make, reason):
    got = check_update(make(), template())
    assert got is not None and reason in got
    assert check_update(update(0, 5, 1.0), template()) is None
    reordered = update(0, 5, 1.0)
    reordered.delta = dict(reversed(reordered.delta.items()))  # safetensors sorts names; order is free
    assert check_update(reordered, template()) is None


def test_a_huge_norm_is_scaled_to_the_bound_relative_to_the_median():
    ups = [update(i, 10, 0.1 * (i + 1)) for i in range(4)] + [update(9, 10, 1e30)]
    bounded, clipped = bound_norms(ups, norm_bound=5.0)
    norms = [float(flatten(u.delta).norm()) for u in bounded]
    median_norm = sorted(float(flatten(u.delta).norm()) for u in ups)[2]
    assert clipped == [9]
    assert norms[-1] == pytest.approx(5.0 * median_norm, rel=1e-6)
    assert norms[:4] == pytest.approx([float(flatten(u.delta).norm()) for u in ups[:4]])


def test_absolute_clip_norm():
    bounded, clipped = bound_norms([update(0, 1, 3.0), update(1, 1, 0.01)], clip_norm=1.0)
    assert clipped == [0]
    assert float(flatten(bounded[0].delta).norm()) == pytest.approx(1.0)
    assert torch.equal(flatten(bounded[1].delta), flatten(update(1, 1, 0.01).delta))


def test_median_and_trimmed_mean_resist_an_outlier():
    ups = [update(0, 1, 1.0), update(1, 1, 2.0), update(2, 1, 3.0), update(3, 1, 4.0), update(4, 1000, 1e6)]
    assert torch.allclose(flatten(median(ups)), torch.full((9,), 3.0, dtype=torch.float64))
    assert torch.allclose(flatten(trimmed_mean(ups, 0.2)), torch.full((9,), 3.0, dtype=torch.float64))  # mean of 2, 3, 4
    assert torch.allclose(flatten(median(ups[:4])), torch.full((9,), 2.5, dtype=torch.float64))
    assert float(flatten(weighted_mean(ups))[0]) > 9e5  # the plain weighted mean is captured by it


def test_coordinator_survives_hostile_uploads_and_aggregates_the_good_ones():
    # Prepare: 5 clients sampled; 3 good, the others send NaN, a wrong shape, garbage types, a second upload.
    coord = coordinator("federated.clients=5", "federated.min_clients=2", "federated.norm_bound=0")
    plan = coord.open_round(list(range(5)))
    assert plan.clients == [0, 1, 2, 3, 4]
    good = [update(0, 10, 1.0), update(1, 10, 1.0), update(2, 20, 4.0)]
    # Execute
    results = [coord.submit(u.client_id, 1, u.delta, {"num_samples": u.num_samples, "loss": 0.5}) for u in good]
    results.append(coord.submit(3, 1, {"w": torch.full((2, 3), math.nan), "b": torch.zeros(3)}, {"num_samples": 1}))
    results.append(coord.submit(4, 1, {"w": "not a tensor"}, {"num_samples": None}))
    late = coord.submit(0, 1, update(0, 10, 100.0).delta, {"num_samples": 10})
    stranger = coord.submit(7, 1, update(7, 10, 100.0).delta, {"num_samples": 10})
    stale = coord.submit(1, 0, update(1, 10, 100.0).delta, {"num_samples": 10})
    record = coord.close_round()
    # Assert
    assert [ok for ok, _ in results] == [True, True, True, False, False]
    assert not late[0] and "already uploaded" in late[1]
    assert not stranger[0] and "not sampled" in stranger[1]
    assert not stale[0] and "not open" in stale[1]
    assert record["clients"] == 3 and set(record["rejected"]) == {"3", "4"} and record["dropped"] == []
    assert torch.allclose(coord.weights["w"], torch.full((2, 3), (10 + 10 + 80) / 40))  # weighted mean of the good ones
    assert record["train_loss"] == pytest.approx(0.5)


def test_below_quorum_the_round_is_skipped_and_the_model_kept():
    coord = coordinator("federated.clients=3", "federated.min_clients=2")
    coord.open_round([0, 1, 2])
    coord.submit(0, 1, update(0, 10, 1.0).delta, {"num_samples": 10})
    record = coord.close_round()
    assert "quorum" in record["skipped"] and record["clients"] == 0 and record["dropped"] == [1, 2]
    assert torch.equal(flatten(coord.weights), flatten(template()))


def test_http_app_answers_hostile_requests_without_crashing():
    from fastapi.testclient import TestClient

    from plait.federated.transport import frame, make_app, unframe

    coord = coordinator("federated.clients=3", "federated.min_clients=1")
    client = TestClient(make_app(coord, {0: "t0", 1: "t1", 2: "t2"}, "fp"))
    auth = lambda c: {"Authorization": f"Bearer t{c}"}
    # authentication: no token, another client's token, wrong fingerprint
    assert client.post("/v1/register", json={"client_id": 0, "fingerprint": "fp"}).status_code == 401
    assert client.post("/v1/register", json={"client_id": 0, "fingerprint": "fp"}, headers=auth(1)).status_code == 401
    assert client.post("/v1/register", json={"client_id": 0, "fingerprint": "xx"}, headers=auth(0)).status_code == 409
    assert client.post("/v1/register", content=b"\x00garbage", headers=auth(0)).status_code == 400
    for c in range(3):
        assert client.post("/v1/register", json={"client_id": c, "fingerprint": "fp"}, headers=auth(c)).status_code == 200
    coord.open_round([0, 1, 2])
    meta, _ = unframe(client.get("/v1/task", params={"client_id": 0}, headers=auth(0)).content)
    assert meta["status"] == "train" and meta["round"] == 1
    up = lambda c, body: client.post("/v1/update", params={"client_id": c, "round": 1}, content=body, headers=auth(c))
    assert up(0, b"not safetensors at all").status_code == 400
    assert up(0, b"\xff" * 8 + b"{}").status_code == 400
    assert up(0, b"x" * (coord.length * 8 * 2 + (2 << 20))).status_code == 413
    bad_shape = up(1, encode({"w": torch.zeros(3, 2), "b": torch.zeros(3)}, {"num_samples": 3}))
    assert bad_shape.status_code == 422 and "shape" in bad_shape.json()["reason"]
    good = up(0, encode(update(0, 4, 2.0).delta, {"num_samples": 4}))
    assert good.status_code == 200 and good.json()["accepted"]
    assert up(2, encode(update(2, 4, 1.0).delta, {"num_samples": 4})).status_code == 200
    record = coord.close_round()
    assert record["clients"] == 2 and record["rejected"] == {"1": "w has shape (3, 2), the model's is (2, 3)"}
    assert torch.allclose(coord.weights["b"], torch.full((3,), 1.5))
    status = client.get("/v1/status", headers=auth(2)).json()
    assert status["round"] == 1 and status["alive"] == [0, 1, 2]
    assert frame({"a": 1}, b"xyz") and unframe(frame({"a": 1}, b"xyz")) == ({"a": 1}, b"xyz")
