"""benchmarks/input_pipeline.py in a tiny run: every loader and worker count measured, the verdict consistent."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "input_pipeline.py"


def test_input_pipeline_benchmark_tiny(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("input_pipeline", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = mod.main(["--images", "60", "--size", "16", "--image-size", "8", "--batch", "8", "--steps", "3",
                  "--workers", "0", "1", "--out", str(tmp_path)])
    assert [row["workers"] for row in r["rows"]] == [0, 1]
    assert all(row[k] > 0 for row in r["rows"] for k in ("torch", "folder", "packed", "packed_augment"))
    best = max(max(row["folder"], row["packed"], row["packed_augment"]) for row in r["rows"])
    assert r["input_bound"] == (best < r["model_samples_per_s"])
    assert r["verdict"].startswith("INPUT-BOUND" if r["input_bound"] else "not input-bound")
    assert (tmp_path / "input_pipeline.json").is_file() and "plait packed" in capsys.readouterr().out
