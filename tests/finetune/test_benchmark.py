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
    assert list(rows) == ["full", "freeze-half", "progressive", "lora-r8", *qlora, "adapters-h16", "adapters-p16",
                          "student-alone", "student-distill"]
    for name, row in rows.items():
        assert set(row) == COLUMNS, name
        assert all(math.isfinite(v) and v > 0 for v in row.values()), (name, row)
    full = rows["full"]
    assert full["trainable"] == full["params"]
    for name in ("freeze-half", "progressive", "lora-r8", "adapters-h16"):  # less trains: less state and traffic
        assert rows[name]["optimizer_bytes"] < full["optimizer_bytes"] and rows[name]["sent_per_step"] < full["sent_per_step"]
    w, blocks = 32, 2  # --tiny: Houlsby's adapters on 2 layers a block, Pfeiffer's on 1; each 2 * 16 * w + 16 + w
    assert rows["adapters-h16"]["trainable"] == 2 * rows["adapters-p16"]["trainable"] == 2 * blocks * (32 * w + 16 + w)
    assert rows["student-alone"]["trainable"] == rows["student-distill"]["trainable"] < full["trainable"]
    out = capsys.readouterr().out
    table = out[out.index("run "):]
    assert table.splitlines()[0].split() == ["run", "trainable", "optimizer", "B", "sent", "B/step", "step", "s", "val", "loss"]
    for name, row in rows.items():
        assert any(line.split()[0] == name and line.split()[-1] == f"{row['val_loss']:.4f}" for line in table.splitlines()[1:]
                   if line.strip()), name
