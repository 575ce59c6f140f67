"""`plait bench collectives`: sizes, the nccl-tests bandwidth formulas, the files it writes, bad names."""

import csv

import pytest

from plait.comm.bench import BenchOptions, bench_rank, format_table, parse_sizes, plot, write_csv
from plait.errors import ConfigError


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
        BenchOptions(ops=["alltoall"]).validate()
    assert str(e.value) == "unknown collective 'alltoall'; choose from allreduce, allgather, reduce_scatter, broadcast"


def test_sweep_rows_follow_the_busbw_formulas(pool2, tmp_path):
    opts = BenchOptions(ops=["allreduce", "allgather", "reduce_scatter", "broadcast"], algos=["native", "ring", "tree"],
                        sizes=[1000, 4096], iters=2, warmup=0).validate()
    rows = pool2.run(bench_rank, opts)[0]
    combos = {(r["op"], r["algo"]) for r in rows}
    assert combos == {("allreduce", "native"), ("allreduce", "ring"), ("allreduce", "tree"), ("allgather", "native"),
                      ("allgather", "ring"), ("reduce_scatter", "native"), ("reduce_scatter", "ring"),
                      ("broadcast", "native"), ("broadcast", "tree")}
    factor = {"allreduce": 2 * 1 / 2, "allgather": 1 / 2, "reduce_scatter": 1 / 2, "broadcast": 1.0}
    for r in rows:
        assert r["correct"], r
        assert r["algbw_GBps"] == pytest.approx(r["size_bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * factor[r["op"]])
    assert sorted({r["size_bytes"] for r in rows}) == [1000, 4096]
    assert "busbw(GB/s)" in format_table(rows).splitlines()[0]
    with open(write_csv(rows, tmp_path / "c.csv")) as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert plot(rows, tmp_path / "c.png").stat().st_size > 1000


def test_cli_prints_the_rule_and_exits_2(capsys):
    from plait.cli import main

    assert main(["bench", "collectives", "--algos", "native,butterfly"]) == 2
    assert capsys.readouterr().err.strip() == "error: unknown algorithm 'butterfly'; choose from hierarchical, native, ring, tree"
