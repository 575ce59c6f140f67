"""benchmarks/overhead.py compares like with like: its hand-written loop and plait's trainer take the same steps (the
same weights, batches, schedule and clipping), so a ratio of their step times measures plait and nothing else."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
STEPS = 6


def _both(scheme: str, run_dir: str):
    """Rank task: the raw loop and plait's trainer, every step logged (log.every = 1)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    import overhead  # noqa: PLC0415 -- benchmarks/ is not a package; its path is set just above

    _, losses, norms = overhead.raw_loop("mlp", 2, STEPS, 0, scheme, every=1)
    zero = f"parallel.zero={0 if scheme == 'ddp' else 3}"
    got = overhead.plait_loop("mlp", 2, STEPS, 0, run_dir, (zero,), every=1)
    windowed = overhead.plait_loop("mlp", 2, STEPS, 0, run_dir + "-w", (zero,), every=3)  # logged at 1, 3, 6
    return losses, norms, got, overhead.agreement(losses, windowed[1], every=3) if windowed else None


@pytest.mark.parametrize("scheme", ["ddp", "fsdp"])
def test_the_raw_loop_and_plait_take_the_same_steps(pool2, scheme, tmp_path):
    losses, norms, (times, logged), windowed = pool2.run(_both, scheme, str(tmp_path / "run"))[0]
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1)) and len(times) == STEPS
    assert losses[-1] < losses[0]  # it trains: the comparison is not of two runs standing still
    assert [r["loss"] for r in logged] == pytest.approx(losses, abs=1e-5)
    assert [r["grad_norm"] for r in logged] == pytest.approx(norms, rel=1e-4)
    # the benchmark's own check, over logging windows (step 1 alone, then 2-3, 4-6), finds the same agreement
    assert windowed <= 1e-5


def _all():
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    import all as bench_all  # noqa: PLC0415 -- benchmarks/ is not a package; its path is set just above

    return bench_all


def test_all_measures_each_baseline_twice_and_judges_against_the_a_a_floor(capsys):
    """benchmarks/all.py: every repeat measures each side once and each baseline twice, the order rotating; a ratio's
    verdict says met, not met, or not met within the A/A floor (the baseline over itself)."""
    b = _all()
    order: list[str] = []
    values = {"base": [10.0, 11.0, 10.0, 9.5, 10.0, 10.0], "fast": [9.0] * 3, "slow": [10.4] * 3, "slower": [20.0] * 3}

    def measure(side, ctx):  # the values of each side in the order it is measured
        order.append(side)
        return {"s": values[side][sum(1 for s in order if s == side) - 1]}

    rows = [b.Row("fast / base", "fast", "base", "s", "lower", 1.0), b.Row("slow / base", "slow", "base", "s", "lower", 1.02),
            b.Row("slower / base", "slower", "base", "s", "lower", 1.02), b.Row("peer", "fast", "base", "s", "lower", None)]
    group = b.Group("g", ["base", "fast", "slow", "slower"], rows, measure)
    a = argparse.Namespace(repeats=3, max_load=1e9, max_other_cpu=1e9, quiet_wait=0)
    done = b.run_group(group, a, Path("."))
    assert len(order) == 15 and order[:5] == ["base", "fast", "slow", "slower", "base"]
    assert order[5:10] == ["fast", "slow", "slower", "base", "base"]  # rotated by one
    judged = [b.judge(r, done["measured"]) for r in rows]
    assert [j["verdict"] for j in judged] == ["met", "not met, within the A/A floor", "not met", "(peer, for reference)"]
    # repeat 1: base 10, its control 11; repeat 2 (rotated) the control first: 10, then base 9.5; repeat 3: 10, 10
    assert judged[0]["aa_ratios"] == pytest.approx([1.1, 10 / 9.5, 1.0]) and judged[0]["floor"] == pytest.approx(0.1)
    assert judged[2]["ratio"] == pytest.approx({"min": 2.0, "median": 2.0, "max": 20 / 9.5})
    md = b.table([{"group": "g", **done, "rows": judged}, {"group": "h", "skipped": "x is not installed"}])
    assert md.splitlines()[3].startswith("| slow / base | 1.040 / 1.040 / 1.095 | 1.000 / 1.053 / 1.100 | 0.100 | <= 1.02 | "
                                         "not met, within the A/A floor | ")
    assert md.splitlines()[-1] == "| h | - | - | - | - | skipped: x is not installed | - |"


def test_all_refuses_an_unknown_group(capsys):
    with pytest.raises(SystemExit):
        _all().main(["--only", "own-loop,nope"])
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "--only nope: no such group (the groups: own-loop, small-step, gpt, serve, tune, deepspeed)")
