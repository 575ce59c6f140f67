"""An elastic job resized to the processes it now has (plait.launch.job.fit, fit_to_world): dp follows the world
through Layout.resolve, every other degree (cp, tp, pp) and the global batch stay (issue 56 item 5)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from plait.config import load_config
from plait.errors import ConfigError
from plait.launch.job import fit, fit_to_world
from plait.parallel.layout import Layout

# cfg.elastic (the agent restarts the workers at whatever size the job has then); a micro batch that splits at 2 to 8
ELASTIC = ["launch.max_restarts=1", "train.micro_batch_size=4"]


def env(world: int) -> SimpleNamespace:
    """What plait.launch.env.resolve says of a job of `world` processes, as far as fit reads it."""
    return SimpleNamespace(world_size=world, rank=0, world_source=lambda: "torchrun's WORLD_SIZE")


@pytest.mark.parametrize("axis", ["cp", "tp", "pp"])
def test_a_resize_keeps_cp_tp_and_pp_and_moves_dp_alone(axis, capsys):
    cfg = load_config(None, [*ELASTIC, "parallel.dp=2", f"parallel.{axis}=2"])
    small = fit(cfg, env(2))  # four processes -> two: the dp = 1, cp = 2 job is 2 processes (dp = 2, 4, before)
    assert (small.parallel.dp, getattr(small.parallel, axis), small.launch.nproc_per_node) == (1, 2, 2)
    assert Layout.from_config(small).world_size == 2
    assert capsys.readouterr().out.strip() == ("world size is 2 (the config asks for 4): data parallel 2 -> 1, "
                                               "accumulation 4 -> 8, global batch 32 unchanged")
    big = fit_to_world(small, 8)
    assert (big.parallel.dp, getattr(big.parallel, axis), Layout.from_config(big).world_size) == (4, 2, 8)


def test_a_resize_no_whole_dp_fits_is_refused_with_the_arithmetic():
    cfg = load_config(None, [*ELASTIC, "parallel.dp=2", "parallel.cp=2"])
    with pytest.raises(ConfigError, match="^" + re.escape(
            "no whole parallel.dp fits the resized job's WORLD_SIZE = 3 processes: dp * cp(2) * tp(1) * pp(1) = 3 "
            "leaves dp = 3 / 2; give the job a multiple of 2 processes, or change parallel.cp")):
        fit(cfg, env(3))


def test_a_job_that_is_not_elastic_keeps_its_layout_and_names_both_numbers():
    cfg = load_config(None, ["parallel.dp=1", "parallel.cp=2"])
    assert fit(cfg, env(2)) is cfg  # the layout's own size: nothing to fit
    with pytest.raises(ConfigError, match="^" + re.escape(
            "the layout needs dp(1) * cp(2) * tp(1) * pp(1) = 2 processes but torchrun's WORLD_SIZE = 4; change "
            "parallel.dp")):
        fit(cfg, env(4))
