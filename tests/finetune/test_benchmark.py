"""benchmarks/finetune.py --tiny end to end: every variant's row, every column, finite numbers that relate as they must."""

from __future__ import annotations

import math

from ft_helpers import load_benchmark

COLUMNS = {"trainable", "params", "optimizer_bytes", "sent_per_step", "step_s", "val_loss"}


def test_the_tiny_benchmark_fills_the_whole_table(pool2, tmp_path, capsys):
    bench = load_benchmark()
    pool2.run(load_benchmark, True)  # the ranks import the benchmark's pool task by its module name
    rows = bench.main(["--tiny", "--out", str(tmp_path)], pool=pool2)
    try:
        import bitsandbytes  # noqa: F401
        qlora = ["qlora-nf4"]
    except ImportError:
        qlora = []
    assert list(rows) == ["full", "freeze-half", "progressive", "lora-r8", *qlora, "student-alone", "student-distill"]
    for name, row in rows.items():
        assert set(row) == COLUMNS, name
        assert all(math.isfinite(v) and v > 0 for v in row.values()), (name, row)
    full = rows["full"]
    assert full["trainable"] == full["params"]
    for name in ("freeze-half", "progressive", "lora-r8"):  # less trains: less optimizer state and traffic
        assert rows[name]["optimizer_bytes"] < full["optimizer_bytes"] and rows[name]["sent_per_step"] < full["sent_per_step"]
    assert rows["student-alone"]["trainable"] == rows["student-distill"]["trainable"] < full["trainable"]
    out = capsys.readouterr().out
    table = out[out.index("run "):]
    assert table.splitlines()[0].split() == ["run", "trainable", "optimizer", "B", "sent", "B/step", "step", "s", "val", "loss"]
    for name, row in rows.items():
        assert any(line.split()[0] == name and line.split()[-1] == f"{row['val_loss']:.4f}" for line in table.splitlines()[1:]
                   if line.strip()), name
