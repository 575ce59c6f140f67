"""The load generator of `plait bench serve`: closed and open loop against a real server, target checks, plot."""

import asyncio

import pytest

from plait.bench.serve import BenchOptions, Point, closed_loop, format_table, open_loop, plot, request_body, target_checks
from plait.serve.entrypoints.server import ServerThread
from plait.serve.model.load import ModelRef, load_model
from plait.serve.service import ServeOptions
from serve_helpers import mlp_run  # noqa: F401


def test_closed_and_open_loop_measure_a_real_server(mlp_run):  # noqa: F811
    body = request_body(load_model(ModelRef(str(mlp_run))))
    with ServerThread(mlp_run, ServeOptions(max_delay_ms=1)) as srv:
        path = "/v2/models/mlp/infer"
        tput, lat, errors = asyncio.run(closed_loop("127.0.0.1", srv.port, path, body, 4, 0.1, 0.5))
        assert errors == 0 and len(lat) > 0 and tput == pytest.approx(len(lat) / 0.5)
        assert all(0 < t < 0.5 for t in lat)
        tput, lat, errors, dropped = asyncio.run(open_loop("127.0.0.1", srv.port, path, body, 40.0, 0.1, 1.0, seed=3))
        assert errors == 0 and dropped == 0 and 15 <= len(lat) <= 70  # Poisson(40) arrivals in one second
        bad = asyncio.run(closed_loop("127.0.0.1", srv.port, "/v2/models/nope/infer", body, 2, 0.0, 0.2))
        assert bad[0] == 0 and bad[2] > 0  # 404s are counted as errors, not throughput


def test_target_checks_table_and_plot(tmp_path):
    opts = BenchOptions(concurrency=[1, 16], max_delay_ms=5, replicas=[1])
    points = [Point("batching off, 1 replica", "closed c=16", 16, None, 100.0, 50, 60, 70, 0),
              Point("batching on, 1 replica", "closed c=16", 16, None, 350.0, 20, 30, 9.0, 0)]
    assert target_checks(points, opts, compute_ms=2.0) == [
        "target: batching serves >= 3x the requests/s of no batching at concurrency 16, 1 replica: 3.50x: met",
        "target: p99 latency with batching at concurrency 16, 1 replica <= max_delay 5 ms + 2 x batch compute 2.00 ms "
        "= 9.00 ms: 9.00 ms: met",
    ]
    points[1].throughput, points[1].p99_ms = 250.0, 9.5
    assert [c.rsplit(": ", 1)[1] for c in target_checks(points, opts, compute_ms=2.0)] == ["not met on this machine"] * 2
    table = format_table(points).splitlines()
    assert table[0].split() == ["configuration", "load", "req/s", "p50", "ms", "p95", "ms", "p99", "ms", "errors"]
    assert table[2].split()[-5:] == ["100.0", "50.00", "60.00", "70.00", "0"]
    out = plot(points, tmp_path / "b.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_prints_its_table_once_and_says_what_a_missed_target_means(monkeypatch, tmp_path, capsys):
    from types import SimpleNamespace

    import plait.bench.serve as bench

    class FakeServer:  # no processes: the printing is what is tested
        def __init__(self, model, args):
            self.name, self.host, self.port = "mlp", "127.0.0.1", 1
            self.batching = args[args.index("--max-batch-size") + 1] != "1"

        def stop(self):
            pass

    servers = []
    monkeypatch.setattr(bench, "load_model", lambda ref: SimpleNamespace(registry_name="mlp", spec=SimpleNamespace(
        task="classification")))
    monkeypatch.setattr(bench, "request_body", lambda served: b"{}")
    monkeypatch.setattr(bench, "batch_compute_ms", lambda served, rows: 2.0)
    monkeypatch.setattr(bench, "ServerProcess", lambda m, a: servers.append(FakeServer(m, a)) or servers[-1])

    async def closed(host, port, path, body, c, warm, dur):  # batching on: 2x the throughput (below the 3x target)
        return (200.0 if servers[-1].batching else 100.0) * c, [0.001] * 10, 0

    async def opened(host, port, path, body, rate, warm, dur):
        return rate, [0.002] * 10, 0, 0

    monkeypatch.setattr(bench, "closed_loop", closed)
    monkeypatch.setattr(bench, "open_loop", opened)
    assert bench.run_bench("runs/x", BenchOptions(concurrency=[1, 16], replicas=[1], out=tmp_path)) == 0
    out = capsys.readouterr().out
    assert out.count(bench.HEADER) == 1 and "MISS" not in out and "PASS" not in out
    rows = [line for line in out.splitlines() if line.startswith("batching ")]
    assert len(rows) == 6 == len(set(rows))  # closed c=1, c=16 and open, batching off and on: each once
    assert "2.00x: not met on this machine" in out and bench.MISSED in out
    assert "p99 latency with batching at concurrency 16, 1 replica <= max_delay 5 ms + 2 x batch compute 2.00 ms = " \
           "9.00 ms: 1.00 ms: met" in out


@pytest.mark.parametrize("verb", [["serve"], ["bench", "serve"]])
def test_serve_help_states_every_default(verb):
    import argparse

    from plait.cli import build_parser

    parser = build_parser()
    for word in verb:
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[word]
    text = " ".join(parser.format_help().split())
    with_default = [a for a in parser._actions if a.option_strings and a.default is not None and a.default is not False
                    and a.dest != "help"]
    assert len(with_default) >= (19 if verb == ["serve"] else 10)
    for a in with_default:
        assert (a.help or "").strip(), a.dest
        assert "default" in " ".join(parser._get_formatter()._expand_help(a).split()), a.dest
    assert "(default: 8000)" in text and "(default: 30000)" in text if verb == ["serve"] else "(default: 0:2)" in text
