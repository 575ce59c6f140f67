"""`plait bench collectives`: sizes, the files it writes, bad names (the sweep itself runs in test_comm_algorithms.py,
on that module's pools of 2, 3 and 4 ranks)."""

import csv

import pytest

from plait.comm.bench import BenchOptions, _row, format_table, parse_sizes, plot, write_csv
from plait.errors import ConfigError

NATIVE = [1e-4, 3e-4, 2e-4, 9e-4, 1e-4]  # seconds per call in five repeats; a burst of load hit the fourth
RING = [2e-4, 3e-4, 4e-4, 9e-4, 1e-4]
ROWS = [_row(op, algo, 2, size, NATIVE if algo == "native" else RING, NATIVE, True)
        for op in ("allreduce", "broadcast") for algo in ("native", "ring") for size in (1024, 4096)]


def test_rows_give_the_median_the_spread_and_the_paired_ratio_to_native():
    r = _row("allreduce", "ring", 4, 4096, RING, NATIVE, True)
    assert r["time_us"] == pytest.approx(300.0) and r["time_min_us"] == pytest.approx(100.0)
    assert r["time_max_us"] == pytest.approx(900.0)
    assert r["busbw_GBps"] == pytest.approx(4096 / 3e-4 / 1e9 * 1.5)
    assert r["busbw_min_GBps"] == pytest.approx(4096 / 9e-4 / 1e9 * 1.5)
    assert r["busbw_max_GBps"] == pytest.approx(4096 / 1e-4 / 1e9 * 1.5)
    assert r["vs_native"] == pytest.approx(1.0)  # repeat by repeat: 0.5, 1, 0.5, 1, 1 -> median 1
    assert _row("allreduce", "ring", 4, 4096, RING, None, True)["vs_native"] is None
    assert "call_median_us" not in r
    # rank 0's calls one by one: the median call, and the share that took over 3x it (two of ten)
    calls = _row("allreduce", "ring", 2, 4096, RING, NATIVE, True, calls=[1e-4] * 8 + [3.5e-4, 4e-3])
    assert calls["call_median_us"] == pytest.approx(100.0) and calls["stalled"] == pytest.approx(0.2)


def test_sizes_parse_like_nccl_tests():
    assert parse_sizes("1K:64M") == [1024 * 2**k for k in range(17)]
    assert parse_sizes("1K:1M", 4) == [1024, 4096, 16384, 65536, 262144, 1048576]
    assert parse_sizes("4096,1.5K,2M") == [4096, 1536, 2 * 1024 * 1024]
    with pytest.raises(ConfigError, match="the first size must not exceed the last"):
        parse_sizes("1M:1K")


def test_bad_names_are_rejected_with_the_choices():
    with pytest.raises(ConfigError) as e:
        BenchOptions(algos=["native", "butterfly"]).validate()
    assert str(e.value) == "unknown algorithm 'butterfly'; choose from hierarchical, native, ring, tree"
    with pytest.raises(ConfigError) as e:
        BenchOptions(ops=["gather"]).validate()
    assert str(e.value) == "unknown collective 'gather'; choose from allreduce, allgather, reduce_scatter, broadcast, alltoall"


def test_algorithms_a_collective_lacks_are_said_not_silently_dropped():
    opts = BenchOptions(ops=["allreduce", "allgather", "reduce_scatter"], algos=["native", "ring", "tree"]).validate()
    assert opts.left_out() == ["allgather: tree left out (allgather runs native, ring here)",
                               "reduce_scatter: tree left out (reduce_scatter runs native, ring here)"]


def test_cli_prints_the_rule_and_exits_2(capsys):
    from plait.cli import main

    assert main(["bench", "collectives", "--algos", "native,butterfly"]) == 2
    assert capsys.readouterr().err.strip() == "error: unknown algorithm 'butterfly'; choose from hierarchical, native, ring, tree"


def test_table_csv_and_plot(tmp_path):
    table = format_table(ROWS).splitlines()
    assert table[0].split()[-7:] == ["algbw(GB/s)", "busbw(GB/s)", "busbw", "min-max", "vs", "native", "check"]
    assert table[4].split()[-7:] == ["ring", "300.0", "0.014", "0.014", "0.005-0.041", "1.00x", "ok"]
    with open(write_csv(ROWS, tmp_path / "c.csv")) as f:
        assert len(list(csv.DictReader(f))) == len(ROWS)
    assert plot(ROWS, tmp_path / "c.png").stat().st_size > 1000
