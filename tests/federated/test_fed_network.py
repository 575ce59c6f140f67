"""`plait fed server` and three `plait fed client` processes over HTTP on loopback; then one client is killed mid-run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file

from fed_helpers import fed_config
from plait.federated.simulate import simulate

TOKEN = "test-token-5c1e"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PLAIT_FED_TOKEN": TOKEN}
COMMON = ["federated.clients=3", "federated.min_clients=2", "federated.local_epochs=1", "federated.port=0",
          "log.report=false"]


def _sets(overrides):
    return [arg for o in overrides for arg in ("--set", o)]


class Procs:
    """Every process a test starts; all are killed and reaped at the end, whatever happened."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, *args: str, log: Path) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-m", "plait", "fed", *args], env=ENV, stdout=open(log, "w"),
                             stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


@pytest.fixture
def procs():
    ps = Procs()
    yield ps
    ps.close()
    assert all(p.poll() is not None for p in ps.procs)  # nothing leaked


def start_run(procs, tmp_path, overrides, clients=3):
    run = tmp_path / "server"
    server = procs.start("server", "--out", str(run), *_sets(COMMON + overrides), log=tmp_path / "server.log")
    end = time.monotonic() + 60
    while not (run / "endpoint.json").exists():
        assert server.poll() is None, (tmp_path / "server.log").read_text()
        assert time.monotonic() < end, "server did not start"
        time.sleep(0.1)
    port = json.loads((run / "endpoint.json").read_text())["port"]
    workers = [procs.start("client", "--server", f"127.0.0.1:{port}", "--client-id", str(i), *_sets(COMMON + overrides),
                           log=tmp_path / f"client{i}.log") for i in range(clients)]
    return run, server, workers, port


@pytest.mark.slow
def test_server_and_three_clients_as_processes_match_the_simulation(procs, tmp_path):
    # Prepare: 4 rounds; every client in every round, so the networked run must equal the in-process simulation.
    overrides = ["federated.rounds=4"]
    run, server, workers, _ = start_run(procs, tmp_path, overrides)
    # Execute
    assert server.wait(timeout=120) == 0, (tmp_path / "server.log").read_text()
    codes = [w.wait(timeout=60) for w in workers]
    # Assert
    assert codes == [0, 0, 0], [(tmp_path / f"client{i}.log").read_text() for i in range(3)]
    summary = json.loads((run / "summary.json").read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert summary["rounds"] == 4 and [r["clients"] for r in records] == [3, 3, 3, 3]
    assert records[-1]["test_accuracy"] > records[0]["test_accuracy"]
    sim = simulate(fed_config(*COMMON, *overrides), tmp_path / "sim", log=None)
    net_w, sim_w = load_file(run / "model.safetensors"), load_file(tmp_path / "sim" / "model.safetensors")
    assert max(float((net_w[k] - sim_w[k]).abs().max()) for k in sim_w) <= 1e-6
    assert summary["test_accuracy"] == pytest.approx(sim["test_accuracy"])
    assert "trained 4 rounds" in (tmp_path / "client0.log").read_text()


@pytest.mark.slow
def test_a_client_killed_mid_round_is_waited_for_then_the_quorum_proceeds(procs, tmp_path):
    # Prepare: 6 rounds of 3 clients; deadline 6 s, quorum 2; a client silent for 3 s is no longer sampled.
    overrides = ["federated.rounds=6", "federated.round_deadline_s=6", "federated.heartbeat_timeout_s=3"]
    run, server, workers, port = start_run(procs, tmp_path, overrides)
    status = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    # Execute: kill client 2 while round 2 waits for its update.
    end = time.monotonic() + 90
    while True:
        s = status.get("/v1/status").json()
        if s["round"] >= 2 and s["phase"] == "train" and 2 in s["selected"] and 2 not in s["received"]:
            break
        assert time.monotonic() < end and server.poll() is None, (tmp_path / "server.log").read_text()
        time.sleep(0.02)
    killed_in = s["round"]
    os.kill(workers[2].pid, signal.SIGKILL)
    status.close()
    # Assert: the server never fails, the other clients finish, the run has all its rounds.
    assert server.wait(timeout=120) == 0, (tmp_path / "server.log").read_text()
    assert [workers[0].wait(timeout=60), workers[1].wait(timeout=60)] == [0, 0]
    assert workers[2].wait(timeout=10) == -signal.SIGKILL
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    log = (tmp_path / "server.log").read_text()
    assert [r["round"] for r in records] == [1, 2, 3, 4, 5, 6] and not any(r.get("skipped") for r in records), log
    hit = [r for r in records if r["dropped"] == [2]]
    assert hit and hit[0]["round"] in (killed_in, killed_in + 1)
    assert all(r["clients"] == 2 for r in hit) and all(r["round_time_s"] >= 5.9 for r in hit)  # waited for the deadline
    later = records[hit[-1]["round"]:]
    assert later and all(r["selected"] == 2 and r["clients"] == 2 and r["round_time_s"] < 5.9 for r in later)
    assert records[-1]["test_accuracy"] > records[0]["test_accuracy"]


def test_tls_and_tokens_on_a_real_socket(tmp_path):
    # Prepare: a self-signed certificate for 127.0.0.1 and a server in this process (port 0: any free port).
    import shutil

    from fed_helpers import coordinator
    from plait.federated.transport import FederatedError, FedHTTPClient, HTTPServerThread, make_app

    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    coord = coordinator("federated.clients=2", "federated.min_clients=1")
    http = HTTPServerThread(make_app(coord, {"*": TOKEN}, "fp"), "127.0.0.1", 0, str(cert), str(key))
    port = http.start()
    try:
        # Execute / Assert: the right CA and token work; an unverified certificate or a wrong token do not.
        good = FedHTTPClient(f"127.0.0.1:{port}", TOKEN, ca_file=str(cert))
        assert good.base.startswith("https://")
        assert good.register(1, 32, "fp", connect_timeout_s=5)["rounds"] == coord.fed.rounds
        coord.open_round([1])
        task, weights = good.task(1)
        assert task["status"] == "train" and set(weights) == set(coord.weights)
        assert good.upload(1, 1, {k: v + 1 for k, v in weights.items()}, {"num_samples": 3}) == (True, "accepted")
        good.close()
        untrusted = FedHTTPClient(f"https://127.0.0.1:{port}", TOKEN, lost_after_s=0.5)
        with pytest.raises(FederatedError, match="cannot reach"):
            untrusted.register(0, 32, "fp", connect_timeout_s=0.5)
        untrusted.close()
        wrong = FedHTTPClient(f"127.0.0.1:{port}", "not-the-token", ca_file=str(cert))
        with pytest.raises(FederatedError, match="wrong bearer token"):
            wrong.register(0, 32, "fp", connect_timeout_s=5)
        wrong.close()
    finally:
        http.stop()
    assert not http.thread.is_alive()


def test_server_without_clients_and_client_without_token_are_user_errors(tmp_path, capsys, monkeypatch):
    from plait.cli import main

    monkeypatch.delenv("PLAIT_FED_TOKEN", raising=False)
    # a server no client reaches gives up after federated.start_timeout_s, with the rule and the fix
    assert main(["fed", "server", "--out", str(tmp_path / "s"), "--set", "federated.port=0",
                 "--set", "federated.start_timeout_s=0.3", "--set", "log.report=false"]) == 2
    out, err = capsys.readouterr()
    assert "clients must use the token in" in out and len((tmp_path / "s" / "token").read_text().strip()) >= 24
    assert (tmp_path / "s" / "token").stat().st_mode & 0o077 == 0  # readable by its owner only
    assert err.startswith("error: only 0 of federated.min_clients = 2 clients connected") and len(err.splitlines()) == 1
    assert main(["fed", "client", "--server", "127.0.0.1:1", "--client-id", "0"]) == 2
    assert "a client needs the server's token" in capsys.readouterr().err


def test_a_client_started_before_its_server_says_it_is_waiting(capsys):
    import socket

    from plait.federated.transport import FederatedError as Refused
    from plait.federated.transport import FedHTTPClient

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = FedHTTPClient(f"127.0.0.1:{port}", "t")
    with pytest.raises(Refused, match=f"cannot reach the server at http://127.0.0.1:{port}"):
        c.register(0, 5, "fp", connect_timeout_s=0.6)
    c.close()
    err = capsys.readouterr().err
    assert f"waiting for the server at http://127.0.0.1:{port} (ConnectError); retrying for up to 1 s more" in err, err
