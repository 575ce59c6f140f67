"""benchmarks/overhead.py compares like with like: its hand-written loop and plait's trainer take the same steps (the
same weights, batches, schedule and clipping), so a ratio of their step times measures plait and nothing else."""

from __future__ import annotations

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
