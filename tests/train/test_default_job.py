"""The built-in default job (`plait train` with no config): what a newcomer's first run shows."""

from plait.config import load_config
from plait.train.job import check_job


def test_the_default_job_evaluates_every_100_steps():
    # The report's validation curve has several points: at 100, 200, 300 and the final step 400 (the trainer's
    # rule: every eval_every steps before the last, and at the end). An evaluation is 256 samples forward only:
    # measured on the default job, 3 more of them add 0.45 s to a run of about 4 minutes.
    cfg = load_config(None)
    check_job(cfg)
    t = cfg.train
    points = [s for s in range(1, t.steps + 1) if s % t.eval_every == 0 and s != t.steps] + [t.steps]
    assert points == [100, 200, 300, 400]
    assert load_config(None, ["train.eval_every=0"]).train.eval_every == 0  # only at the end, as before
