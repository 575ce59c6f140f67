"""The built-in default job (`plait train` with no config): what a newcomer's first run shows."""

import json

import pytest

from plait.config import load_config
from plait.train.job import check_job
from plait.train.trainer import train

# The default job shrunk to seconds on one process: model, batch, data and evaluation size only. Steps and
# eval_every stay the default's, so the run evaluates where the default job does.
SHRUNK = ["model.layers=1", "model.width=16", "model.heads=1", "model.context=8", "parallel.dp=1",
          "train.global_batch_size=2", "train.micro_batch_size=2", "train.eval_samples=2", "train.eval_batch_size=2",
          "train.sample_tokens=0", "data.min_char_count=1", "log.progress=false", "log.report=false",
          "log.every=100", "checkpoint.every=0"]


def evaluated_steps(tiny_text, run_dir, *overrides: str) -> list[int]:
    cfg = load_config(None, [*SHRUNK, "data.name='text'", f"data.path='{tiny_text}'", *overrides])
    train(cfg, run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "val_loss" in r]


def test_the_default_job_is_400_steps_evaluated_every_100():
    cfg = load_config(None)
    check_job(cfg)
    assert (cfg.train.steps, cfg.train.eval_every) == (400, 100)


# The report's validation curve has several points. An evaluation is 256 samples forward only: measured on the
# default job, 3 more of them add 0.45 s to a run of about 4 minutes.
@pytest.mark.parametrize(("overrides", "expected"), [((), [100, 200, 300, 400]),
                                                     (("train.eval_every=0",), [400])],  # only at the end, as before
                         ids=["default", "eval_every=0"])
def test_the_default_job_evaluates_every_100_steps(tiny_text, tmp_path, overrides, expected):
    assert evaluated_steps(tiny_text, tmp_path / "run", *overrides) == expected
