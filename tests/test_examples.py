"""Every shipped example config is valid."""

from pathlib import Path

import pytest

from plait.parallel.layout import Layout
from plait.train.job import load_job

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.toml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_is_valid(path):
    cfg = load_job(path)
    assert Layout.from_config(cfg).world_size == cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp


def test_there_are_examples():
    assert len(EXAMPLES) >= 3
