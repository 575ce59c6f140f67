"""log.trackers: TensorBoard event files hold the numbers metrics.jsonl holds (read back with TensorBoard's reader)."""

import json
import re

import pytest

from helpers import rank0_params, tiny_gpt_config
from plait.config import load_config
from plait.errors import ConfigError
from plait.train.metrics import MetricsWriter

pytest.importorskip("tensorboard", reason="needs TensorBoard: pip install 'plait[tensorboard]' (in the dev extra)")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def scalars(run_dir, tag: str) -> list[tuple[int, float]]:
    ea = EventAccumulator(str(run_dir / "tensorboard"))
    ea.Reload()
    return [(e.step, e.value) for e in ea.Scalars(tag)]


def test_every_numeric_field_becomes_a_scalar_at_its_step(tmp_path):
    w = MetricsWriter(tmp_path / "metrics.jsonl", keep_through=0, trackers=["tensorboard"])
    w.write({"event": "session", "restart_count": 0})  # no step: metrics.jsonl only
    w.write({"step": 1, "loss": 2.5, "lr": 0.1, "time": {"data": 0.25}, "flag": True, "ranks": [1.0, 2.0]})
    w.write({"step": 2, "loss": 2.0, "lr": 0.1, "time": {"data": 0.5}})
    w.close()
    assert scalars(tmp_path, "loss") == [(1, 2.5), (2, 2.0)]
    assert scalars(tmp_path, "time/data") == [(1, 0.25), (2, 0.5)]
    tags = EventAccumulator(str(tmp_path / "tensorboard")).Reload().Tags()["scalars"]
    assert sorted(tags) == ["loss", "lr", "time/data"]


def test_a_distributed_run_writes_the_losses_it_logs(pool2, tiny_text, tmp_path):
    cfg = tiny_gpt_config(tiny_text, "train.steps=4", "log.every=1", "log.trackers=['tensorboard']")
    pool2.run(rank0_params, cfg, tmp_path)
    logged = [(m["step"], m["loss"]) for m in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
              if "loss" in m]
    got = scalars(tmp_path, "loss")
    assert [s for s, _ in got] == [s for s, _ in logged] == [1, 2, 3, 4]
    assert [v for _, v in got] == pytest.approx([v for _, v in logged], rel=1e-6)  # TensorBoard stores float32


def test_an_unknown_tracker_is_a_config_error():
    with pytest.raises(ConfigError,
                       match=r"log.trackers: 'comet' is not a tracker plait writes; choose from \['mlflow', 'tensorboard', "
                             r"'wandb'\]"):
        load_config(None, ["log.trackers=['comet']"])


def _counts(cfg_args):
    """Pool task: the header's parameter counts of a one-step run at this layout."""
    from helpers import tiny_gpt_config  # noqa: F401 -- the harness's path
    from plait.parallel import check_config
    from plait.train.telemetry import model_counts
    from plait.train.trainer import train

    cfg, run_dir = cfg_args
    result = train(cfg, run_dir)
    return model_counts(result.strategy, check_config(cfg), result.runtime)


def test_the_header_counts_the_whole_model_at_pp2(pool2, tiny_text, tmp_path):
    """At pp = 2 each stage holds half the blocks: the count is summed over the stages, equal to dp = 2's."""
    from helpers import tiny_gpt_config

    base = ("train.steps=1", "train.sample_tokens=0", "train.eval_samples=0", "log.report=false")
    runs = {}
    for name, layout in (("dp", ("parallel.dp=2",)), ("pp", ("parallel.dp=1", "parallel.pp=2"))):
        cfg = tiny_gpt_config(tiny_text, *base, *layout)
        runs[name] = pool2.run(_counts, (cfg, tmp_path / name))
    assert runs["dp"][0] == runs["dp"][1] == runs["pp"][0] == runs["pp"][1]
    total, trainable = runs["pp"][0]
    assert total == trainable > 1000


def test_each_evaluation_before_the_last_is_printed(tmp_path):
    """log.progress: an evaluation mid-run prints its validation figures (the last one is in the closing summary)."""
    from helpers import plait

    job = tmp_path / "job.toml"
    job.write_text('[model]\nname = "mlp"\nwidth = 16\ndepth = 1\n[data]\nname = "digits"\n[train]\nsteps = 4\n'
                   'global_batch_size = 16\nmicro_batch_size = 16\neval_every = 2\neval_samples = 32\n'
                   'sample_tokens = 0\n[parallel]\ndp = 1\n[log]\nprogress = true\nreport = false\n')
    r = plait("train", job, "--out", tmp_path / "run")
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ": validation " in ln]
    assert len(lines) == 1 and re.fullmatch(r"step 2/4: validation loss \d+\.\d{4}, accuracy \d\.\d{4}", lines[0])
