"""Secure aggregation: the masked sum is exact, one masked update says nothing about its update, dropouts are recovered."""

import numpy as np
import pytest
import torch

from fed_helpers import coordinator, update
from plait.federated import secagg
from plait.federated.client import Client
from plait.federated.secagg import MaskedSum, MaskingClient, decode, encode
from plait.federated.tensors import flatten


def _clients(n):
    clients = [MaskingClient(i) for i in range(n)]
    return clients, {c.client_id: c.public for c in clients}


def test_pairwise_keys_agree_and_masks_cancel_exactly():
    # Prepare: 5 clients with random vectors of 10 000 values.
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(10_000, generator=g, dtype=torch.float64) * 3 for _ in range(5)]
    clients, peers = _clients(5)
    # Execute
    total = MaskedSum(list(peers), 10_000)
    for c, x in zip(clients, xs):
        total.add(c.client_id, c.masked(x, 7, peers))
    got = total.result()
    # Assert: bit-exact against the sum of the fixed-point encodings, and within 5 * 2^-25 of the float sum.
    exact = decode(sum((encode(x) for x in xs), np.zeros(10_000, dtype=np.uint64)))
    assert torch.equal(got, exact)
    assert float((got - sum(xs)).abs().max()) <= 5 * 2.0**-25
    assert secagg.agree(clients[0].secret, clients[1].public) == secagg.agree(clients[1].secret, clients[0].public)


def test_a_masked_update_is_uncorrelated_with_the_update():
    x = torch.linspace(-1, 1, 200_000, dtype=torch.float64) + 0.1 * torch.randn(200_000, dtype=torch.float64)
    clients, peers = _clients(3)
    masked = clients[0].masked(x, 1, peers).view(np.int64).astype(np.float64)
    r = np.corrcoef(masked, x.numpy())[0, 1]
    assert abs(r) < 0.01  # the mask is a one-time pad: r ~ N(0, 1/n), |r| < 0.01 at > 4 sigma for n = 200 000
    # and without the masks the encoding is (of course) perfectly correlated: the test can fail
    assert np.corrcoef(encode(x).view(np.int64).astype(np.float64), x.numpy())[0, 1] > 0.99
    # masks are fresh every round: the same update in two rounds gives unrelated uploads
    again = clients[0].masked(x, 2, peers).view(np.int64).astype(np.float64)
    assert abs(np.corrcoef(masked, again)[0, 1]) < 0.01


def test_a_client_that_drops_after_masking_is_recovered_from_the_survivors():
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(1000, generator=g, dtype=torch.float64) for _ in range(4)]
    clients, peers = _clients(4)
    total = MaskedSum(list(peers), 1000)
    for c, x in list(zip(clients, xs))[:3]:  # client 3 computed its masks' partners but never uploads
        total.add(c.client_id, c.masked(x, 3, peers))
    assert total.dropped == [3] and not total.complete
    with pytest.raises(ValueError, match="did not reveal"):
        total.result()
    for c in clients[:3]:
        total.recover(c.client_id, c.reveal(3, peers, total.dropped, min_survivors=2))
    assert total.complete
    assert float((total.result() - sum(xs[:3])).abs().max()) <= 3 * 2.0**-25


def test_clients_refuse_to_unmask_down_to_a_single_survivor():
    clients, peers = _clients(3)
    with pytest.raises(ValueError, match="refusing"):
        clients[0].reveal(1, peers, [1, 2], min_survivors=2)
    with pytest.raises(ValueError, match="not in the round"):
        clients[0].reveal(1, {0: peers[0], 1: peers[1], 2: peers[2]}, [5], min_survivors=2)
    with pytest.raises(ValueError, match="outside the group"):
        secagg.agree(clients[0].secret, 1)


def test_coordinator_round_with_masks_and_a_dropout_gives_the_weighted_mean():
    # Prepare: a coordinator with secure aggregation; 4 clients, client 2 drops after the masks were fixed.
    coord = coordinator("federated.clients=4", "federated.secure_aggregation=true", "federated.min_clients=2")
    values = {0: (10, 1.0), 1: (30, 2.0), 2: (5, 100.0), 3: (60, -1.0)}
    clients = {}
    for cid in values:
        clients[cid] = Client(cid, None, None, np.arange(values[cid][0]), None, 0)
        coord.register(cid, clients[cid].masking.public)
    coord.open_round([0, 1, 2, 3])
    # Execute
    for cid, (n, v) in values.items():
        task, _ = coord.task(cid)
        peers = {int(k): int(p) for k, p in task["peers"].items()}
        if cid == 2:
            continue
        masked = clients[cid].masked_upload(1, update(cid, n, v), task["instructions"], peers)
        ok, _ = coord.submit(cid, 1, {"masked": torch.from_numpy(masked.view(np.int64))}, {"secagg": True})
        assert ok
    assert coord.begin_recovery()
    for cid in (0, 1, 3):
        task, _ = coord.task(cid)
        assert task["status"] == "unmask" and task["dropped"] == [2]
        seeds = clients[cid].masking.reveal(1, {int(k): int(p) for k, p in task["peers"].items()}, task["dropped"], 2)
        assert coord.submit_unmask(cid, 1, seeds)[0]
    record = coord.close_round()
    # Assert: (10 * 1 + 30 * 2 + 60 * -1) / 100 = 0.1, computed by a server that never saw an update.
    assert record["clients"] == 3 and record["dropped"] == [2]
    assert torch.allclose(flatten(coord.weights), torch.full((9,), 0.1, dtype=torch.float64), atol=1e-6)


def test_a_survivor_that_does_not_help_recovery_fails_the_round_cleanly():
    coord = coordinator("federated.clients=3", "federated.secure_aggregation=true", "federated.min_clients=2")
    clients = {cid: Client(cid, None, None, np.arange(10), None, 0) for cid in range(3)}
    for cid, c in clients.items():
        coord.register(cid, c.masking.public)
    coord.open_round([0, 1, 2])
    for cid in (0, 1):
        task, _ = coord.task(cid)
        masked = clients[cid].masked_upload(1, update(cid, 10, 5.0), task["instructions"],
                                            {int(k): int(p) for k, p in task["peers"].items()})
        coord.submit(cid, 1, {"masked": torch.from_numpy(masked.view(np.int64))}, {"secagg": True})
    assert coord.begin_recovery()
    bad = coord.submit_unmask(0, 1, {"9": "1"})  # wrong peer: refused, no crash
    assert not bad[0]
    record = coord.close_round()  # client 1 never answers
    assert "secure aggregation failed" in record["skipped"] and record["clients"] == 0
    assert float(flatten(coord.weights).abs().max()) == 0.0  # unchanged, not corrupted by leftover masks
