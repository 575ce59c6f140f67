"""benchmarks/gpu_check.py --device cpu --tiny: every part runs on CPU, and its numbers hold together.

The script is what a short GPU session runs; this runs the same code paths here (gloo, world size 1)
so that the GPU's minutes go to measuring. One run (~30 s) feeds every test below.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
PARTS = ["train_default", "numerics", "zero3", "train_large", "train_llama", "serve"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--out", str(out), "--timeout-s", "130"],
                          capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert out.is_file(), f"no JSON written\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc, json.loads(out.read_text()), out


def test_every_part_runs_and_passes(run):
    proc, report, out = run
    assert list(report["parts"]) == PARTS
    failed = {name: (p["status"], p.get("error")) for name, p in report["parts"].items() if p["status"] != "ok"}
    assert not failed, f"{failed}\n{proc.stdout[-4000:]}"
    assert proc.returncode == 0 and report["ok"] is True
    # One table of everything, printed and in the JSON; one log per part beside the JSON.
    assert "all parts ok" in proc.stdout
    for name in PARTS:
        assert any(r["part"] == name for r in report["table"])
        assert name in proc.stdout
        assert out.with_name(f"gpu_check_{name}.log").is_file()
    assert all(r["ok"] is not False for r in report["table"])
    env = report["env"]
    assert env["torch"] and env["python"] and env["device_name"]
    assert report["device"] == "cpu" and report["tiny"] is True


@pytest.mark.parametrize("part", ["train_default", "train_large", "train_llama"])
def test_mfu_is_the_palm_formula_over_the_reported_throughput(run, part):
    m = run[1]["parts"][part]["metrics"]
    assert m["head_dim"] * m["heads"] == m["width"]
    per_token = 6 * m["params"] + 12 * m["layers"] * m["heads"] * m["head_dim"] * m["seq_len"]
    assert m["flops_per_token"] == per_token
    assert m["tokens_per_s"] > 0 and m["peak_flops"] > 0
    assert m["mfu"] == pytest.approx(per_token * m["tokens_per_s"] / m["peak_flops"], rel=1e-12)
    # tokens/s and step time describe the same steps
    assert m["tokens_per_s"] * m["step_time_s"] == pytest.approx(m["tokens_per_step"], rel=1e-9)
    assert m["tokens_per_step"] == m["global_batch"] * m["seq_len"]
    first, last = m["measured_steps"]
    assert 1 < first <= last < m["steps"]  # after the warm-up, before the last (memory-measuring) window
    assert "measured" in m["peak_flops_source"]  # a CPU has no table entry: its matmul rate, labelled so


@pytest.mark.parametrize("part", ["train_default", "train_large"])
def test_peak_memory_and_syncs_on_cpu(run, part):
    m = run[1]["parts"][part]["metrics"]
    assert m["peak_memory_bytes"] > 50 * 2**20  # peak RSS: Python + torch + the data
    assert "RSS" in m["peak_memory_kind"]
    assert m["syncs_per_non_logging_step"] is None and "not applicable" in m["syncs_note"]
    assert m["precision"] == "bf16" and m["backend"] == "gloo" and m["device"] == "cpu"
    assert m["loss_last"] < m["loss_first"]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(abs(a[k] - b[k]) for k in a)


def test_mixed_precision_stays_on_the_fp32_trajectory(run):
    report = run[1]
    tol = report["tolerances"]
    t = report["parts"]["numerics"]["metrics"]["trajectories"]
    ref = t["ref_cpu_fp32"]
    assert len(ref) >= 5
    assert _max_diff(t["cpu_fp32"], ref) == 0.0  # the "device" run is the reference's job on the same device
    for dtype in ("bf16", "fp16"):
        diff = _max_diff(t[f"cpu_{dtype}"], ref)
        assert 0 < diff <= tol[dtype], dtype  # > 0: autocast really ran in that precision
    assert report["parts"]["numerics"]["metrics"]["fp16_skipped_steps"] == 0


@pytest.mark.parametrize("part, straight", [("numerics", "cpu_fp16"), ("zero3", "zero3_fp32")])
def test_resume_continues_the_same_loss(run, part, straight):
    m = run[1]["parts"][part]["metrics"]
    resumed, whole = m["resumed"], m["trajectories"][straight]
    assert sorted(resumed, key=int) == sorted(whole, key=int)
    assert resumed == whole  # on CPU a checkpoint -> load -> resume is bitwise the uninterrupted run
    assert m["resume_bitwise"] is True and m["resume_max_diff"] == 0.0


def test_zero3_on_a_one_rank_mesh_matches_a_single_process(run):
    report = run[1]
    part = report["parts"]["zero3"]
    t = part["metrics"]["trajectories"]
    assert _max_diff(t["zero3_fp32"], t["ref_cpu_fp32"]) <= report["tolerances"]["fp32"]
    assert 0 < _max_diff(t["zero3_bf16"], t["ref_cpu_fp32"]) <= report["tolerances"]["bf16"]
    assert any("DTensor" in r["item"] and r["ok"] for r in part["rows"])


def test_serving_batches_and_generates(run):
    m = run[1]["parts"]["serve"]["metrics"]
    assert m["errors"] == 0 and m["served_on"] == "cpu"
    assert m["concurrency"] >= 2
    points = {(p["config"], p["concurrency"]): p for p in m["points"]}
    c = m["concurrency"]
    assert [p["errors"] for p in points.values()] == [0, 0, 0, 0], points
    # with batching on, concurrent requests shared batches: more than one row each, never more than the clients
    assert 1 < m["mean_batch_rows"] <= c
    # the gain is on / off at the same concurrency (on 2 shared cores with a 0.4 M-parameter model the ratio is
    # noise, which is why --tiny sets no target for it: its value is checked against its points, not a threshold)
    on, off = points["batching on", c]["throughput"], points["batching off", c]["throughput"]
    assert m["batching_gain"] == (pytest.approx(on / off, rel=1e-12) if off else math.inf), points
    row = next(r for r in run[1]["table"] if r["item"].startswith(f"batching gain at concurrency {c}"))
    assert row["value"] == (pytest.approx(m["batching_gain"], rel=1e-12) if off else "inf") and row["ok"] is None
    rates = m["generate_tokens_per_s"]
    assert rates["1"] > 0 and rates[str(m["concurrency"])] > 0
    assert m["prompt_tokens"] + m["new_tokens"] <= 128  # within the context: the KV-cache path
    configs = {(p["config"], p["concurrency"]) for p in m["points"]}
    assert configs == {(c, n) for c in ("batching off", "batching on") for n in (1, m["concurrency"])}


def test_a_second_try_skips_what_passed(run, tmp_path):
    _, first, out = run
    again = tmp_path / "again.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--parts", "zero3,serve",
                           "--previous", str(out), "--out", str(again)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(again.read_text())
    assert list(report["parts"]) == ["zero3", "serve"]
    for name in ("zero3", "serve"):
        assert report["parts"][name]["from_previous"] == str(out)
        assert report["parts"][name]["metrics"] == first["parts"][name]["metrics"]
    assert not math.isnan(report["wall_s"]) and report["wall_s"] < 30


def test_the_sync_counter_counts_non_logging_steps_only(monkeypatch, tiny_text):
    """The GPU-only bookkeeping, on CPU: a sync warning raised inside a step is charged to that step, and only
    non-logging steps after the warm-up are watched (set_sync_debug_mode itself is CUDA's, stubbed here)."""
    import types
    import warnings

    import torch

    import plait.train.build as trainer  # where the job builds its Telemetry
    from plait.config import load_config
    from plait.parallel.base import Strategy
    from plait.train.trainer import train

    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import gpu_check

    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(trainer, "Telemetry", trainer.Telemetry)  # restored after the test
    step = Strategy.optimizer_step

    def syncing_step(self):
        warnings.warn(f"called a {gpu_check.SYNC_WARNING}", stacklevel=1)  # as CUDA's sync debug mode does
        step(self)

    monkeypatch.setattr(Strategy, "optimizer_step", syncing_step)
    cfg = load_config(None, ["parallel.dp=1", "model.width=32", "model.layers=1", "model.heads=2", "model.context=32",
                             "train.global_batch_size=4", "train.micro_batch_size=4", "train.steps=8", "log.every=4",
                             "log.progress=false", "log.report=false", "train.sample_tokens=0", "train.eval_samples=0",
                             "data.name='text'", f"data.path='{tiny_text}'"])
    with warnings.catch_warnings():  # the probe's filter and hook go with it
        probe = gpu_check.Probe(types.SimpleNamespace(cuda=True, device=torch.device("cpu")))
        probe.install()
        probe.reset(warm=2)
        train(cfg, None)
    assert sorted(probe.syncs) == [3, 5, 6, 7]  # steps 1, 4 and 8 log; 2 is warm-up
    assert all(len(sites) == 1 and "test_gpu_check.py" in sites[0] for sites in probe.syncs.values())
    assert modes == ["warn", "default"] * 4
    assert sorted(probe.losses()) == [1, 4, 8]
