"""log.trackers = ["mlflow", "wandb"]: the MLflow file store and the W&B offline run hold the losses metrics.jsonl holds
(read back with MLflow's client and W&B's own protobuf records), written by rank 0 alone; a missing package is a
config error naming the extra."""

import importlib.util
import json
import struct

import pytest
import torch

from plait.config import load_config
from plait.errors import ConfigError

pytest.importorskip("mlflow", reason="needs MLflow: pip install 'plait[mlflow]' (in the dev extra)")
pytest.importorskip("wandb", reason="needs W&B: pip install 'plait[wandb]' (in the dev extra)")
# the run: tracked_run in conftest.py (4 steps on 2 ranks with every installed tracker)


def wandb_history(run_file) -> list[dict]:
    """The history rows of a .wandb file: a LevelDB-style log (32 KiB blocks, 7-byte chunk headers) of Record protos."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunks, partial = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7 or data[pos:pos + 7] == bytes(7):  # a block's zero-filled tail
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:  # full
            chunks.append(chunk)
        elif kind == 2:  # first
            partial = chunk
        elif kind == 3:  # middle
            partial += chunk
        elif kind == 4:  # last
            chunks.append(partial + chunk)
    rows = []
    for chunk in chunks:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    return rows


def test_the_mlflow_file_store_holds_the_logged_losses(tracked_run, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store only with this opt-in

    run_dir, logged = tracked_run
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("plait").experiment_id])  # one run: rank 0's
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [(m["step"], m["loss"]) for m in logged]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "time/forward_backward")] == \
        [m["time"]["forward_backward"] for m in logged]
    assert run.info.status == "FINISHED"
    params = run.data.params  # the resolved config, flattened, with the layout and the model's size: runs filter by them
    assert (params["train.steps"], params["log.every"], params["train.eval_every"]) == ("4", "1", "2")
    assert params["model.name"] == "gpt" and params["log.trackers"] == json.dumps(["mlflow", "wandb"])
    assert params["plait.world_size"] == "2" and params["plait.layout"].startswith("dp=2")
    assert int(params["plait.params"]) == int(params["plait.trainable_params"]) > 1000
    assert len(params) > 100


def test_the_wandb_offline_run_holds_the_logged_losses(tracked_run):
    run_dir, logged = tracked_run
    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")  # one run: rank 0's
    rows = wandb_history(run_file)
    assert [(r["_step"], r["loss"]) for r in rows] == [(m["step"], m["loss"]) for m in logged]


@pytest.mark.parametrize("tracker", ["mlflow", "wandb"])
def test_a_missing_package_is_a_config_error_naming_the_extra(tracker, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == tracker else find_spec(name, *a))
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"log.trackers=['{tracker}']"])
    # the install command pins the installed torch, so installing the extra keeps it
    assert str(e.value) == (f"log.trackers = ['{tracker}'] needs the {tracker} package: pip install 'plait[{tracker}]' "
                            f"'torch=={torch.__version__.split('+')[0]}'")
