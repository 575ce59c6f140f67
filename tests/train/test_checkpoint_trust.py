"""Checkpoints from someone else: DCP's pickled .metadata, manifests, `latest` (docs/security.md, rows 1 and 17).

A run directory is built by hand (config, spec, one checkpoint of a tiny MLP), so nothing here trains.
"""

import dataclasses
import json
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from plait.cli import main
from plait.config import dump_config, load_config
from plait.data.spec import DataSpec
from plait.errors import CheckpointError
from plait.models import build_model
from plait.train.checkpoint import (
    MANIFEST,
    TRUST_ENV,
    Checkpointer,
    find_resumable,
    latest_checkpoint,
    load_checkpoint,
    load_model_weights,
    read_metadata,
    verify,
    write_manifest,
)


class _Runtime:
    rank, is_main = 0, True

    def barrier(self) -> None:
        pass


class _Strategy:
    """What a Checkpointer needs: a state dict with the model's and an optimizer's state."""

    optional_state = ()  # entries a checkpoint of another layout may lack (StepStrategy's member)

    def __init__(self, model):
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 1, 8, 8)).sum().backward()
        self.opt.step()

    def state_dict(self):
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def load_state_dict(self, sd):
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["optim"])


class _Boom:
    """Unpickling it runs a command (what a crafted .metadata does)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _model():
    cfg = load_config(None, ["model.name='mlp'", "data.name='digits'", "model.width=16"])
    spec = DataSpec(name="digits", task="classification", input_shape=[1, 8, 8], num_classes=10)
    torch.manual_seed(0)
    return cfg, spec, build_model(cfg.model, spec)


@pytest.fixture
def run(tmp_path):
    """A run directory with one published checkpoint (step 5) of a tiny MLP."""
    cfg, spec, model = _model()
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(dump_config(cfg))
    (run / "spec.json").write_text(json.dumps(dataclasses.asdict(spec)))
    Checkpointer(run, _Runtime(), keep=3).save(_Strategy(model), 5, {})
    return run


def _step(run):
    return run / "checkpoints" / "step_0000005"


def test_a_plain_checkpoint_still_round_trips(run):
    ckpt = _step(run)
    cfg, spec, saved = _model()
    _Strategy(saved)  # the same seed and step as the fixture's: the weights that were saved
    torch.manual_seed(1)
    strategy = _Strategy(build_model(cfg.model, spec))
    state = load_checkpoint(strategy, ckpt)  # model and optimizer state (non-tensor entries read with weights_only)
    assert state["step"] == 5 and strategy.opt.state_dict()["param_groups"][0]["betas"] == (0.9, 0.999)
    for k, v in saved.state_dict().items():
        assert torch.equal(strategy.model.state_dict()[k], v), k


def test_crafted_metadata_is_refused_even_with_a_recomputed_manifest(run, tmp_path, capsys):
    """Row 1: a .metadata that runs code on load; the attacker recomputes the manifest's CRCs."""
    ckpt, marker = _step(run), tmp_path / "pwned"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Boom(marker)))
    write_manifest(ckpt)  # the CRC-32s match again: the manifest is no signature
    verify(ckpt)
    _, _, model = _model()
    with pytest.raises(CheckpointError, match=r"\.metadata names posix\.system, which is not part of a checkpoint's metadata"):
        load_model_weights(model, ckpt)
    assert main(["export", str(run)]) == 2  # the CLI: one line, exit 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "posix.system" in err and len(err.strip().splitlines()) == 1
    assert main(["serve", str(run), "--port", "0"]) == 2
    assert "posix.system" in capsys.readouterr().err
    assert not marker.exists()


def test_a_non_tensor_entry_that_would_run_code_is_refused(tmp_path):
    """DCP stores non-tensor state with torch.save; plait reads it back with weights_only=True."""
    ckpt, marker = tmp_path / "step_0000001", tmp_path / "pwned"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP says it runs as one process
        dcp.save({"model": {"w": torch.zeros(2)}, "extra": _Boom(marker)}, checkpoint_id=str(ckpt), no_dist=True)
    (ckpt / "trainer_state.json").write_text('{"step": 1}')
    write_manifest(ckpt)

    class Holder:
        optional_state = ()

        def state_dict(self):
            return {"model": {"w": torch.ones(2)}, "extra": 0}

        def load_state_dict(self, sd):
            raise AssertionError("must not get here")

    with pytest.raises(CheckpointError, match="entry extra is not plain data"):
        load_checkpoint(Holder(), ckpt)
    assert not marker.exists()


def test_metadata_pointing_outside_the_checkpoint_is_refused(run):
    ckpt = _step(run)
    md = read_metadata(ckpt)
    info = next(iter(md.storage_data.values()))
    info.relative_path = "../../../etc/passwd"
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    write_manifest(ckpt)
    with pytest.raises(CheckpointError, match=r"points to '\.\./\.\./\.\./etc/passwd', which is not a data file"):
        read_metadata(ckpt)


def test_a_checkpoint_without_a_manifest_needs_trust(run, monkeypatch, capsys):
    """Row 17: deleting manifest.json used to turn verification off."""
    ckpt = _step(run)
    (ckpt / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="has no manifest.json.*pass --trust-checkpoint"):
        verify(ckpt)
    said = []
    with pytest.raises(CheckpointError, match="no checkpoint under .* verifies"):
        find_resumable(run, log=said.append)
    assert "has no manifest.json" in said[0]
    assert main(["export", str(run)]) == 2 and "--trust-checkpoint" in capsys.readouterr().err
    # issue 37 N13: `train --resume` refuses it once, in the launcher, before any worker starts
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"no checkpoint under {run / 'checkpoints'} verifies" in err and "Traceback" not in err, err
    assert verify(ckpt, trust=True)["step"] == 5
    assert main(["export", str(run), "--trust-checkpoint"]) == 0
    monkeypatch.setenv(TRUST_ENV, "1")  # how --trust-checkpoint reaches training workers
    assert find_resumable(run) == ckpt


def test_a_manifest_must_cover_the_metadata(run):
    ckpt = _step(run)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    del manifest["files"][".metadata"]
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="does not cover .metadata"):
        verify(ckpt)
    (ckpt / MANIFEST).write_text('{"files": {"../x": {"bytes": 1, "crc32": 2}}}')
    with pytest.raises(CheckpointError, match="is corrupt"):
        verify(ckpt)


def test_latest_is_confined_to_the_run(run, tmp_path):
    """Row 17: `latest` (or a step_ entry) pointing outside checkpoints/ is not followed."""
    elsewhere = tmp_path / "elsewhere" / "step_0000009"
    elsewhere.parent.mkdir()
    os.replace(_step(run), elsewhere)
    root = run / "checkpoints"
    (root / "latest").unlink()
    (root / "latest").symlink_to(elsewhere)
    with pytest.raises(CheckpointError, match="outside"):
        latest_checkpoint(run)
    (root / "step_0000009").symlink_to(elsewhere)  # a step_ entry that leads out
    said = []
    with pytest.raises(CheckpointError, match="no checkpoint under .* verifies"):
        find_resumable(run, log=said.append)
    assert any("leads outside" in s for s in said)


def test_a_dangling_latest_is_said_before_falling_back(run):
    """Issue 37 N15: a `latest` whose target is gone made `train --resume` fall back without a word."""
    root = run / "checkpoints"
    (root / "latest").unlink()
    (root / "latest").symlink_to("step_0000099")
    said = []
    assert find_resumable(run, log=said.append) == _step(run)
    assert said == [f"warning: {root / 'latest'} points to step_0000099, which is not there; falling back to the newest "
                    "checkpoint that verifies"]
