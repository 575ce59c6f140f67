"""plait.procs: a spawned child sees the variables set for it; the parent's environment comes back; failed starts raise."""

import os
import pickle

import pytest

from plait.procs import CONTEXT, child_env, spawn


def report_env(conn, keys):
    conn.send({k: os.environ.get(k) for k in keys})


def test_child_sees_its_env_and_the_parent_keeps_its_own(monkeypatch):
    monkeypatch.setenv("PLAIT_PROCS_KEPT", "parent")
    monkeypatch.delenv("PLAIT_PROCS_NEW", raising=False)
    parent, child = CONTEXT.Pipe()
    proc = spawn(report_env, (child, ["PLAIT_PROCS_KEPT", "PLAIT_PROCS_NEW"]), name="plait-test-child",
                 env={"PLAIT_PROCS_KEPT": "child", "PLAIT_PROCS_NEW": "1"})
    assert proc.name == "plait-test-child" and proc.daemon
    assert os.environ["PLAIT_PROCS_KEPT"] == "parent" and "PLAIT_PROCS_NEW" not in os.environ
    assert parent.poll(60), "the child did not report"
    assert parent.recv() == {"PLAIT_PROCS_KEPT": "child", "PLAIT_PROCS_NEW": "1"}
    proc.join(30)
    assert proc.exitcode == 0


def test_a_failed_start_raises_and_restores_the_env(monkeypatch):
    monkeypatch.delenv("PLAIT_PROCS_NEW", raising=False)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        spawn(report_env, (lambda: 0, []), env={"PLAIT_PROCS_NEW": "1"})  # a lambda cannot be sent to the child
    assert "PLAIT_PROCS_NEW" not in os.environ


def test_child_env_restores_on_error(monkeypatch):
    monkeypatch.setenv("PLAIT_PROCS_KEPT", "parent")
    with pytest.raises(RuntimeError), child_env({"PLAIT_PROCS_KEPT": "child"}):
        assert os.environ["PLAIT_PROCS_KEPT"] == "child"
        raise RuntimeError
    assert os.environ["PLAIT_PROCS_KEPT"] == "parent"
