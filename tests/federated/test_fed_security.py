"""Hostile clients against the federated server (docs/security.md rows 4, 6, 7, 13, 18) and a fuzz of its HTTP API."""

import json
import os
import stat

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from fed_helpers import coordinator, fed_config, template, update
from plait.federated.commands import write_private
from plait.federated.secagg import MaskingClient, P, agree
from plait.federated.server import cap_weights
from plait.federated.tensors import encode, flatten
from plait.federated.transport import make_app

AUTH = {"Authorization": "Bearer t"}


# ------------------------------------------------------------------ row 4: a client's weight is bounded

def test_a_count_above_the_clients_partition_is_rejected():
    """Row 4: one client sending -100x its update while claiming 10^9 samples took accuracy from 0.944 to 0.089."""
    coord = coordinator("federated.clients=3", "federated.norm_bound=0")
    coord.sizes = {0: 10, 1: 10, 2: 10}  # what build_coordinator knows from the shared partition
    coord.open_round([0, 1, 2])
    for cid in (0, 1):
        assert coord.submit(cid, 1, update(cid, 10, 1.0).delta, {"num_samples": 10})[0]
    ok, reason = coord.submit(2, 1, update(2, 10**9, -100.0).delta, {"num_samples": 10**9})
    assert not ok and reason == "num_samples 1000000000 is more than client 2's partition holds (10)"
    coord.close_round()
    assert torch.allclose(coord.weights["w"], torch.ones(2, 3))  # the honest mean


def test_without_known_sizes_a_weight_is_capped_relative_to_the_median():
    coord = coordinator("federated.clients=3", "federated.norm_bound=0")
    coord.open_round([0, 1, 2])
    for cid in (0, 1):
        coord.submit(cid, 1, update(cid, 10, 1.0).delta, {"num_samples": 10})
    assert coord.submit(2, 1, update(2, 10**9, -100.0).delta, {"num_samples": 10**9})[0]
    coord.close_round()
    # 4 x the lower median (10): the attacker weighs 40 of 60, not 10^9 of 10^9 + 20
    assert torch.allclose(coord.weights["w"], torch.full((2, 3), (10 + 10 - 100 * 40) / 60))
    assert [u.num_samples for u in cap_weights([update(0, 5, 1.0), update(1, 10**9, 1.0)])] == [5, 20]


def test_the_inflated_client_has_no_influence_on_a_real_round():
    """The audit's attack on the real FedAvg digits job: the round ends exactly as if the liar had not uploaded."""
    from plait.federated.client import build_client, federated_data
    from plait.federated.server import build_coordinator

    cfg = fed_config("federated.clients=5", "federated.clients_per_round=5")
    data = federated_data(cfg)

    def one_round(liar_uploads: bool):
        coord = build_coordinator(cfg, data)
        client = build_client(cfg, data, 0)
        plan = coord.open_round(list(range(5)))
        for cid in plan.clients:
            task, weights = coord.task(cid)
            client.indices, client.client_id = data.parts[cid], cid
            u = client.train(task["round"], weights, task["instructions"])
            if cid == 4:
                if not liar_uploads:
                    continue
                u.delta, u.num_samples = {k: -100 * v for k, v in u.delta.items()}, 10**9
            coord.submit(cid, task["round"], u.delta, {"num_samples": u.num_samples})
        return coord.close_round(), coord.weights

    attacked, w_attacked = one_round(True)
    honest, w_honest = one_round(False)
    assert "partition holds" in attacked["rejected"]["4"]
    assert all(torch.equal(w_attacked[k], w_honest[k]) for k in w_honest)
    assert attacked["test_accuracy"] == honest["test_accuracy"] > 0.2


def test_secure_aggregation_refuses_a_total_weight_above_the_partitions():
    coord = coordinator("federated.clients=2", "federated.secure_aggregation=true", "federated.min_clients=2")
    coord.sizes = {0: 10, 1: 10}
    clients = {c: MaskingClient(c) for c in (0, 1)}
    for c, m in clients.items():
        coord.register(c, m.public)
    coord.open_round([0, 1])
    for c, m in clients.items():
        task, _ = coord.task(c)
        w = 10.0 if c == 0 else 1e9  # client 1 claims 10^9 samples inside its masked vector
        vec = torch.cat([flatten(update(c, 1, 1.0).delta) * w, torch.tensor([w], dtype=torch.float64)])
        masked = m.masked(vec, 1, {int(k): int(v) for k, v in task["peers"].items()})
        assert coord.submit(c, 1, {"masked": torch.from_numpy(masked.view(np.int64))}, {})[0]
    record = coord.close_round()
    assert "total weight" in record["skipped"] and torch.equal(flatten(coord.weights), flatten(template()))


# ------------------------------------------------------------------ row 6: re-registering mid-round

def _masked_round(rekey: bool):
    coord = coordinator("federated.clients=3", "federated.secure_aggregation=true", "federated.min_clients=2",
                        "federated.norm_bound=0")
    clients = {c: MaskingClient(c) for c in range(3)}
    for c, m in clients.items():
        coord.register(c, m.public)
    coord.open_round([0, 1, 2])
    for c in range(3):
        task, _ = coord.task(c)
        if rekey and c == 2:  # the client restarts (new key pair) and registers again while the round is open
            clients[2] = MaskingClient(2)
            coord.register(2, clients[2].public)
            task, _ = coord.task(2)
        vec = torch.cat([flatten(update(c, 1, float(c + 1)).delta), torch.tensor([1.0], dtype=torch.float64)])
        masked = clients[c].masked(vec, 1, {int(k): int(v) for k, v in task["peers"].items()})
        assert coord.submit(c, 1, {"masked": torch.from_numpy(masked.view(np.int64))}, {})[0]
    return coord, coord.close_round()


def test_a_client_that_registers_again_mid_round_skips_the_round():
    """Row 6: a new key mid-round left masks uncancelled and the garbage sum was applied."""
    coord, record = _masked_round(rekey=False)
    assert "skipped" not in record and torch.allclose(coord.weights["w"], torch.full((2, 3), 2.0))  # mean of 1, 2, 3
    coord, record = _masked_round(rekey=True)
    assert "registered again with a new key" in record["skipped"]
    assert torch.equal(flatten(coord.weights), flatten(template()))  # never a wrong sum
    coord.open_round([0, 1, 2])  # the next round takes the new key
    assert coord.task(2)[0]["peers"]["2"] == str(coord.public_keys[2])


# ------------------------------------------------------------------ row 7: keys checked at registration

# P is a safe prime: P - 2 = -2 mod P is outside the subgroup of order (P - 1) / 2 that 2 generates (2 is a quadratic
# residue mod P, -1 is not), so it is the small-subgroup key a passive check of the range would let through.
@pytest.mark.parametrize("key", [0, 1, P - 1, P, P + 5, -3, P - 2], ids=["0", "1", "P-1", "P", "P+5", "-3", "outside-subgroup"])
def test_a_degenerate_public_key_is_refused_at_registration(key):
    """Row 7: such a key was accepted, and every honest client then died in key agreement."""
    coord = coordinator("federated.clients=2", "federated.secure_aggregation=true")
    client = TestClient(make_app(coord, {"*": "t"}, "fp"))
    r = client.post("/v1/register", json={"client_id": 0, "public_key": str(key), "fingerprint": "fp"}, headers=AUTH)
    assert r.status_code == 400 and ("public key" in r.json()["reason"] or "public_key" in r.json()["reason"])
    assert 0 not in coord.public_keys
    with pytest.raises(ValueError):
        agree(MaskingClient(1).secret, key)
    good = MaskingClient(0).public
    r = client.post("/v1/register", json={"client_id": 0, "public_key": str(good), "fingerprint": "fp"}, headers=AUTH)
    assert r.status_code == 200 and coord.public_keys[0] == good
    r = client.post("/v1/register", json={"client_id": 1, "fingerprint": "fp"}, headers=AUTH)
    assert r.status_code == 400 and "needs the client's public key" in r.json()["reason"]


# ------------------------------------------------------------------ row 13: deep JSON is a 400

def test_deeply_nested_json_is_a_400():
    """Counted before parsing (plait.jsondepth), so a recursion limit raised by anything else in the process (it
    failed the suite once: a library had raised it, the parser took the body) changes nothing."""
    import sys

    coord = coordinator("federated.clients=2")
    client = TestClient(make_app(coord, {"*": "t"}, "fp"), raise_server_exceptions=False)
    deep = b"[" * 1000 + b"]" * 1000
    before = sys.getrecursionlimit()
    try:
        for limit in (before, 100_000):
            sys.setrecursionlimit(limit)
            for path in ("/v1/register", "/v1/unmask"):
                r = client.post(path, content=b'{"client_id": 0, "x": ' + deep + b"}", headers=AUTH)
                assert r.status_code in (400, 401), r.text
    finally:
        sys.setrecursionlimit(before)


# ------------------------------------------------------------------ issue 37 N15 (part): the token before the body

def test_a_wrong_token_is_401_before_the_body_is_read(monkeypatch):
    """N15: register parsed its body first, so a wrong token with a malformed body got 400 (and the parse ran)."""
    import plait.federated.transport as transport

    coord = coordinator("federated.clients=2", "federated.min_clients=1")
    client = TestClient(make_app(coord, {0: "t0", 1: "t1"}, "fp"), raise_server_exceptions=False)
    reads = []
    real = transport._read_body
    monkeypatch.setattr(transport, "_read_body", lambda request, limit: reads.append(request.url.path) or real(request, limit))
    bodies = [b"\x00garbage", b"[" * 5000, b'{"client_id": 0, "fingerprint": "fp"}']
    for path in ("/v1/register", "/v1/unmask"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "t0"}):
            for body in bodies:
                r = client.post(path, content=body, headers=headers)
                assert r.status_code == 401, (path, headers, body[:10], r.status_code, r.text)
    assert reads == []  # no body was read, let alone parsed
    # with a token of the server's the body is read, and parsed: malformed is 400, another client's id 401
    assert client.post("/v1/register", content=b"\x00garbage", headers={"Authorization": "Bearer t1"}).status_code == 400
    r = client.post("/v1/register", json={"client_id": 0, "fingerprint": "fp"}, headers={"Authorization": "Bearer t1"})
    assert r.status_code == 401 and reads == ["/v1/register", "/v1/register"]
    r = client.post("/v1/register", json={"client_id": 0, "fingerprint": "fp"}, headers={"Authorization": "Bearer t0"})
    assert r.status_code == 200


# ------------------------------------------------------------------ row 18: the token file

def test_the_token_file_is_private_whatever_was_there(tmp_path):
    """Row 18: an existing world-readable `token` kept its mode when the server wrote a token into it."""
    path = tmp_path / "token"
    path.write_text("old\n")
    os.chmod(path, 0o644)
    write_private(path, "new\n")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == "new\n"
    target = tmp_path / "elsewhere"
    target.write_text("keep\n")
    path.unlink()
    path.symlink_to(target)  # a link is replaced, not written through
    write_private(path, "new\n")
    assert not path.is_symlink() and target.read_text() == "keep\n" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "token"]  # no temporary file left


# ------------------------------------------------------------------ fuzz: the federated API never answers 500

@pytest.fixture(scope="module")
def fed_app():
    coord = coordinator("federated.clients=3", "federated.min_clients=1")
    with TestClient(make_app(coord, {"*": "t"}, "fp"), raise_server_exceptions=False) as client:
        client.headers.update(AUTH)
        for c in range(3):
            assert client.post("/v1/register", json={"client_id": c, "public_key": str(MaskingClient(c).public),
                                                     "fingerprint": "fp"}).status_code == 200
        coord.open_round([0, 1, 2])
        yield client, coord


scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=5)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=20)
objects = st.fixed_dictionaries({}, optional={
    "client_id": st.integers(-2, 5) | json_values, "public_key": st.integers(-2, 2**64).map(str) | json_values,
    "fingerprint": st.sampled_from(["fp", "xx"]) | json_values, "round": st.integers(0, 3) | json_values,
    "seeds": st.dictionaries(st.text(max_size=3), st.text(max_size=5) | st.integers()) | json_values})
raw = (st.binary(max_size=200) | st.integers(500, 3000).map(lambda d: b"[" * d + b"]" * d)
       | st.just(b'{"client_id": ' + b"9" * 5000 + b"}"))


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(path=st.sampled_from(["/v1/register", "/v1/unmask", "/v1/update", "/v1/task"]), body=objects | json_values, blob=raw,
       use_raw=st.booleans(), query=st.dictionaries(st.sampled_from(["client_id", "round"]),
                                                    st.integers(-1, 4).map(str) | st.text(max_size=4), max_size=2),
       tensors=st.booleans())
def test_fuzz_federated_api(fed_app, path, body, blob, use_raw, query, tensors):
    client, coord = fed_app
    if path == "/v1/update" and tensors:
        content = encode({"w": torch.zeros(2, 3), "b": torch.zeros(3)}, body if isinstance(body, dict) else {"x": body})
    else:
        content = blob if use_raw else json.dumps(body, allow_nan=True).encode()
    r = client.get(path, params=query) if path == "/v1/task" else client.post(path, params=query, content=content)
    assert r.status_code in (200, 400, 401, 409, 413, 422), (r.status_code, r.text[:300])
    assert client.get("/v1/status").status_code == 200
