"""train.init_from: a run directory or a safetensors file, names and shapes checked, at any layout."""

from __future__ import annotations

import pytest
import torch
from ft_helpers import gpt, run_trajectory

from helpers import tiny_gpt_config
from plait.config import load_config
from plait.errors import ConfigError
from plait.export import export
from plait.train.job import check_job
from plait.train.weights import init_from, load_run_model


def _fresh(tiny_text, *more):
    from plait.data import build_data
    from plait.models import build_model

    cfg = tiny_gpt_config(tiny_text, *more)
    return build_model(cfg.model, build_data(cfg.data, cfg.model).spec)


def test_init_from_a_run_and_from_its_export_load_the_trained_weights(pretrained, tiny_text, tmp_path):
    _, _, trained = load_run_model(pretrained)
    want = trained.state_dict()
    from_run = _fresh(tiny_text)
    assert any(float((from_run.state_dict()[k] - want[k]).abs().max()) > 1e-3 for k in want)  # a fresh init differs
    init_from(from_run, pretrained)
    from_file = _fresh(tiny_text)
    init_from(from_file, export(pretrained, tmp_path / "m.safetensors"))
    for model in (from_run, from_file):
        assert all(torch.equal(model.state_dict()[k], want[k]) for k in want)


def test_a_mismatch_names_the_first_differing_tensor_and_both_shapes(pretrained, tiny_text, tmp_path):
    wider = _fresh(tiny_text, "model.width=48")
    with pytest.raises(ConfigError, match=r"tensor tok_emb.weight has shape \[\d+, 32\] there and \[\d+, 48\] in the model"):
        init_from(wider, pretrained)
    deeper = _fresh(tiny_text, "model.layers=3")
    with pytest.raises(ConfigError, match=r"tensor blocks.2.ln1.weight \(shape \[32\]\) is missing"):
        init_from(deeper, export(pretrained, tmp_path / "m.safetensors"))
    with pytest.raises(ConfigError, match="does not exist"):
        check_job(load_config(None, ["train.init_from='/nonexistent/run'"]))


def test_init_from_starts_step_optimizer_and_schedule_fresh_at_any_layout(pool2, pretrained, tiny_text, tmp_path):
    """dp=1 and ZeRO-3 at dp=2 from the same weights: one trajectory, starting at step 1 from the trained loss."""
    more = (f"train.init_from='{pretrained}'",)
    one = run_trajectory(load_config(None, gpt(tiny_text, "parallel.dp=1", *more)), tmp_path / "one")
    two = pool2.run(run_trajectory, load_config(None, gpt(tiny_text, "parallel.dp=2", "parallel.zero=3", *more)),
                    tmp_path / "two")[0]
    from ft_helpers import assert_same

    assert_same(one, two)
    scratch = run_trajectory(load_config(None, gpt(tiny_text, "parallel.dp=1")), tmp_path / "scratch")
    assert one[0][0] < scratch[0][0] - 0.1  # the first step already starts from the trained model
    assert one[3]["steps"] == 3 and one[3]["resumed_from_step"] is None


def test_a_run_directory_naming_a_foreign_factory_is_refused_before_its_code_runs(tiny_text, tmp_path, monkeypatch):
    """Issue 37 N6: train.init_from = RUN_DIR builds that run's model; its model.factory is code."""
    from plait.config import dump_config

    marker = tmp_path / "ran"
    (tmp_path / "evil_factory.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef make():\n    raise SystemExit\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(dump_config(load_config(None, ["model.factory='evil_factory:make'"])))
    with pytest.raises(ConfigError, match=r"names model.factory = 'evil_factory:make': building its model would import "
                                          r"and call that code; set train.trust_factory=true only if you trust"):
        check_job(tiny_gpt_config(tiny_text, f"train.init_from='{run}'"))
    assert not marker.exists()
