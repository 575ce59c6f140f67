"""`plait bench collectives`: sizes, the files it writes, bad names (the sweep itself runs in test_comm_algorithms.py,
on that module's pools of 2, 3 and 4 ranks)."""

import csv

import pytest

from plait.comm.bench import BenchOptions, format_table, parse_sizes, plot, write_csv
from plait.errors import ConfigError

ROWS = [{"op": op, "algo": algo, "ranks": 2, "size_bytes": size, "count": size // 4, "iters": 2, "time_us": 100.0,
         "algbw_GBps": size / 1e-4 / 1e9, "busbw_GBps": size / 1e-4 / 1e9, "correct": True}
        for op in ("allreduce", "broadcast") for algo in ("native", "ring") for size in (1024, 4096)]


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


def test_cli_prints_the_rule_and_exits_2(capsys):
    from plait.cli import main

    assert main(["bench", "collectives", "--algos", "native,butterfly"]) == 2
    assert capsys.readouterr().err.strip() == "error: unknown algorithm 'butterfly'; choose from hierarchical, native, ring, tree"


def test_table_csv_and_plot(tmp_path):
    assert format_table(ROWS).splitlines()[0].split()[-3:] == ["algbw(GB/s)", "busbw(GB/s)", "check"]
    with open(write_csv(ROWS, tmp_path / "c.csv")) as f:
        assert len(list(csv.DictReader(f))) == len(ROWS)
    assert plot(ROWS, tmp_path / "c.png").stat().st_size > 1000
