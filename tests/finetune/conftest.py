"""Fixtures of the fine-tuning tests: one short pre-trained tiny GPT run that the others start from."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def pretrained(tiny_text, tmp_path_factory):
    """A tiny GPT trained 6 steps in one process (a run directory with a checkpoint)."""
    from helpers import tiny_gpt_config
    from plait.train.trainer import train

    run = tmp_path_factory.mktemp("pretrained") / "run"
    train(tiny_gpt_config(tiny_text, "parallel.dp=1", "train.steps=6", "checkpoint.every=0"), run)
    return run
