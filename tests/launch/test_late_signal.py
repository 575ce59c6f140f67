"""A SIGTERM that reaches the launcher while a finished run is closing loses nothing: exit 0, said so."""

from __future__ import annotations

import json
import signal
import types

from plait.launch.torchrun import report_preemption


def test_a_signal_after_the_run_finished_is_not_an_error(tmp_path, capsys):
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 60, "preempted": False}))
    assert report_preemption(tmp_path, types.SimpleNamespace(sigval=signal.SIGTERM)) == 0
    assert "SIGTERM arrived after the run finished (step 60); nothing to resume" in capsys.readouterr().out


def test_a_signal_before_any_checkpoint_is_still_an_error(tmp_path, capsys):
    assert report_preemption(tmp_path, types.SimpleNamespace(sigval=signal.SIGTERM)) == 1
    assert "error: stopped by SIGTERM before a checkpoint was written" in capsys.readouterr().err
