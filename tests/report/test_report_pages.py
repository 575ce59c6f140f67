"""report.html and `plait runs compare` from recorded run files: human units, no raw dicts, the curves, the config."""

import json
import re
from pathlib import Path

import pytest

from plait.cli import main
from plait.report import write_report
from plait.report.compare import CompareError, compare_runs

SUMMARY = {
    "steps": 40, "resumed_from_step": None, "initial_loss": 4.5, "final_loss": 2.25, "val_loss": 2.3125,
    "world_size": 2, "parallel": {"dp": 2, "tp": 1, "pp": 1, "strategy": "ddp"}, "params": 824320,
    "wall_time_s": 122.3, "train_time_s": 0.5, "tokens_per_s": 13558.3,
    "memory": {"per_rank": [{"params_bytes": 3297280, "optimizer_bytes": 6594832, "peak_rss_bytes": 834621440}] * 2},
    "stragglers": {"flagged_windows_per_rank": {"1": 3}, "factor": 1.5},
    "comm": {"bytes_per_step_per_rank": [3297672.9, 1536.0]},
    "moe": {"experts": 4, "a2a_bytes": 2048},
}


def fake_run(path: Path, final: float = 2.25) -> Path:
    path.mkdir(parents=True)
    lines = [{"event": "session", "restart_count": 0}]
    for s in range(1, 41):
        lines.append({"step": s, "loss": 4.5 - (4.5 - final) * s / 40, "lr": 1e-3 * min(1, s / 10), "grad_norm": 1 / s,
                      "tokens_per_s": 13000.0 + s, "step_time_s": 0.2, "time": {"data": 0.01, "forward_backward": 0.15,
                                                                            "optimizer": 0.02}})
        if s % 20 == 0:
            lines.append({"step": s, "val_loss": final + 0.0625})
    (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (path / "summary.json").write_text(json.dumps({**SUMMARY, "final_loss": final}))
    (path / "config.toml").write_text('[train]\nsteps = 40\n[optim]\nlr = 0.001\n')
    return path


def text_of(page: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<style>.*?</style>|<[^>]+>", " ", page, flags=re.S))


def test_the_report_speaks_human_units_and_shows_curves_and_config(tmp_path):
    run = fake_run(tmp_path / "run")
    page = write_report(run).read_text()
    text = text_of(page)
    for expected in ("parameters 824,320", "wall time 2 min 2 s", "training time 500 ms", "throughput (tokens/s) 13,558",
                     "validation loss 2.312", "parallel dp 2, tp 1, pp 1, strategy ddp",
                     "rank 0 3.14 MiB 6.29 MiB 796 MiB", "rank 1 1.5 KiB", "rank 1: 3 logging windows",
                     "moe experts 4, a2a bytes 2 KiB", "steps = 40"):
        assert expected in text, (expected, text)
    assert "{" not in text and "'" not in text and "_bytes" not in text  # no raw dicts, no snake_case byte keys
    for img in re.findall(r'<img src="([^"]+)"', page):
        assert (run / img).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 'src="curves.png"' in page and 'src="loss.png"' in page and 'src="step_time.png"' in page


def test_runs_compare_puts_the_runs_side_by_side(tmp_path, capsys):
    a, b = fake_run(tmp_path / "a", final=2.25), fake_run(tmp_path / "b", final=1.75)
    assert main(["runs", "compare", str(a), str(b), "--out", str(tmp_path / "cmp")]) == 0
    assert f"wrote {tmp_path / 'cmp' / 'compare.html'}" in capsys.readouterr().out
    text = text_of((tmp_path / "cmp" / "compare.html").read_text())
    assert "a 40 dp2 (ddp) 824,320 2.25 2.312" in text and "b 40 dp2 (ddp) 824,320 1.75 2.312" in text, text
    assert (tmp_path / "cmp" / "compare.png").read_bytes()[:4] == b"\x89PNG"
    assert "what differs the runs' configs are the same" in text
    (b / "config.toml").write_text((b / "config.toml").read_text().replace("steps = 40", "steps = 80"))
    assert main(["runs", "compare", str(a), str(b), "--out", str(tmp_path / "cmp2")]) == 0
    text = text_of((tmp_path / "cmp2" / "compare.html").read_text())
    assert "what differs config key a b train.steps 40 80 loss" in text, text


def test_runs_compare_names_a_directory_that_is_not_a_run(tmp_path):
    a = fake_run(tmp_path / "a")
    with pytest.raises(CompareError, match=f"{tmp_path / 'nope'} has no metrics.jsonl"):
        compare_runs([a, tmp_path / "nope"], tmp_path / "cmp")
    with pytest.raises(CompareError, match="at least two"):
        compare_runs([a], tmp_path / "cmp")
