"""Your own data: data.factory (a map-style dataset, plait's sampler over it) and data.name = "table" (CSV, Parquet)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import plait
from helpers import max_diff, params_after, rank0_params
from plait.config import load_config
from plait.data import build_data
from plait.errors import ConfigError, DataError
from plait.parallel.layout import Layout
from plait.train.job import check_job, check_user_code

# plain SGD, no clipping or schedule: a wrong gradient scale cannot hide (layout tests' rule)
SGD = ["model.name='mlp'", "model.width=16", "model.depth=1", "train.global_batch_size=16", "train.micro_batch_size=8",
       "parallel.dp=1", "train.steps=6", "train.eval_every=0", "train.eval_samples=32", "train.eval_batch_size=16",
       "train.sample_tokens=0", "log.progress=false", "log.report=false", "log.every=1", "checkpoint.every=0",
       "optim.name='sgd'", "optim.lr=0.2", "optim.momentum=0", "optim.weight_decay=0", "optim.grad_clip=0",
       "optim.warmup_steps=0", "optim.schedule='constant'"]
FACTORY = [*SGD, "data.factory='user_code:digits'", "data.options={limit = 300}"]


def _records(run: Path) -> list[tuple[float, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["loss"], r["grad_norm"]) for r in rows if "loss" in r]


def test_factory_dataset_is_indexed_split_and_described():
    cfg = load_config(None, FACTORY)
    b = build_data(cfg.data, cfg.model)
    assert (len(b.train), len(b.val)) == (270, 30)  # val_fraction 0.1 of 300
    assert (b.spec.task, b.spec.input_shape, b.spec.num_classes) == ("classification", [64], 10)
    x, y = b.train.fetch(torch.tensor([0, 5]))
    assert x.shape == (2, 64) and y.dtype == torch.long
    pair = load_config(None, [*SGD, "data.factory='user_code:digits_pair'"])
    b2 = build_data(pair.data, pair.model)
    assert (len(b2.train), len(b2.val)) == (320, 80)  # the factory's own split
    dicts = load_config(None, [*SGD, "data.factory='user_code:digits_dicts'", "data.options={limit = 300}"])
    b3 = build_data(dicts.data, dicts.model)  # dict samples through the dataset's own collate: the same batches
    assert torch.equal(b3.train.fetch(torch.arange(8))[0], b.train.fetch(torch.arange(8))[0])


def test_factory_training_at_dp2_equals_one_process_and_resume_equals_uninterrupted(tmp_path, pool2):
    ref = params_after(load_config(None, FACTORY), tmp_path / "one")
    two = pool2.run(rank0_params, load_config(None, [*FACTORY, "parallel.dp=2"]), tmp_path / "two")[0]
    assert max_diff(two, ref) < 1e-6
    one, dp2 = _records(tmp_path / "one"), _records(tmp_path / "two")
    assert len(one) == 6 and np.allclose(one, dp2, rtol=0, atol=1e-6)  # per-step loss and grad norm
    params_after(load_config(None, [*FACTORY, "train.stop_after=3", "checkpoint.every=3"]), tmp_path / "cut")
    resumed = params_after(load_config(None, [*FACTORY, "checkpoint.every=3"]), tmp_path / "cut", resume=True)
    assert max_diff(resumed, ref) < 1e-6
    assert np.allclose(_records(tmp_path / "cut"), one, rtol=0, atol=1e-6)


@pytest.mark.parametrize("factory, message", [
    ("user_code:not_a_dataset", "data.factory = 'user_code:not_a_dataset' returned range_iterator, which has no "
                                "__len__ / __getitem__: plait's sampler picks samples by index; return a map-style "
                                "dataset (or a (train, val) pair of them)"),
    ("user_code:ragged", "do not collate into a batch (RuntimeError: stack expects each tensor to be equal size, but got "
                         "[63] at entry 0 and [64] at entry 1); give every sample the same shape and type, or the "
                         "dataset a collate(samples) -> (inputs, targets)"),
    ("user_code:missing", "data.factory = 'user_code:missing': module user_code has no callable 'missing'"),
])
def test_bad_factories_are_one_line_errors_before_launch(factory, message):
    with pytest.raises((ConfigError, DataError)) as e:
        check_job(load_config(None, [*SGD, f"data.factory='{factory}'"]))
    assert message in str(e.value) and "\n" not in str(e.value)


def _csv(path: Path, rows: int = 60, seed: int = 0, bad: tuple[int, str] | None = None) -> Path:
    """a, b, c features; `label` a class (0, 1, 2), `price` a real number; row `bad` gets a text cell in column c."""
    rng = np.random.default_rng(seed)
    lines = ["a,b,c,label,price"]
    for i in range(rows):
        a, b, c = rng.normal(size=3)
        cell = bad[1] if bad and bad[0] == i + 1 else f"{c:.4f}"
        lines.append(f"{a:.4f},{b:.4f},{cell},{int(a > 0) + int(b > 0)},{2 * a - b + 0.5:.4f}")
    path.write_text("\n".join(lines) + "\n")
    return path


TABLE = [*SGD, "data.name='table'", "train.global_batch_size=8", "train.micro_batch_size=8", "train.steps=3",
         "train.eval_samples=8", "train.eval_batch_size=8"]


def test_table_classification_and_regression_from_csv_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    csv = _csv(tmp_path / "t.csv")
    cls = load_config(None, [*TABLE, f"data.path='{csv}'", "data.target='label'", "data.features=['a', 'b']"])
    b = build_data(cls.data, cls.model)
    assert (b.spec.task, b.spec.input_shape, b.spec.num_classes, len(b.train), len(b.val)) == ("classification", [2], 3, 54, 6)
    reg = load_config(None, [*TABLE, f"data.path='{csv}'", "data.target='price'"])
    r = build_data(reg.data, reg.model)
    assert (r.spec.task, r.spec.input_shape, r.spec.num_classes) == ("regression", [4], 1)  # a, b, c, label
    x, y = r.train.fetch(torch.arange(len(r.train)))
    # the target as written: 2a - b + 0.5, features in the file's order
    assert torch.allclose(y, 2 * x[:, 0] - x[:, 1] + 0.5, atol=2e-4)
    cols = np.loadtxt(csv, delimiter=",", skiprows=1)
    pq.write_table(pa.table({n: cols[:, k] for k, n in enumerate(["a", "b", "c", "label", "price"])}), tmp_path / "t.parquet")
    rp = load_config(None, [*TABLE, f"data.path='{tmp_path / 't.parquet'}'", "data.target='price'"])
    p = build_data(rp.data, rp.model)
    assert torch.equal(p.train.fetch(torch.arange(5))[0], x[:5])
    params_after(reg, tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    model = plait.load(tmp_path / "run")  # val_loss is the mean squared error of the trained model on the validation rows
    xv, yv = r.val.fetch(torch.arange(len(r.val)))  # 6 rows: one validation batch (eval_samples 8)
    with torch.no_grad():
        mse = float(((model(xv).reshape(-1) - yv) ** 2).mean())
    assert abs(summary["val_loss"] - mse) < 1e-6 and "val_accuracy" not in summary


def test_train_loss_and_eval_metrics_are_the_users_functions(tmp_path):
    """train.loss = plain cross-entropy of one's own: the same run as the built-in loss; a metric reported per evaluation."""
    ref = params_after(load_config(None, FACTORY), None)
    own = params_after(load_config(None, [*FACTORY, "train.loss='user_code:cross_entropy'",
                                          "train.eval_metrics=['user_code:error_rate']"]), tmp_path / "own")
    assert max_diff(own, ref) == 0.0
    summary = json.loads((tmp_path / "own" / "summary.json").read_text())
    assert abs(summary["val_error_rate"] + summary["val_accuracy"] - 1) < 1e-6  # a float32 batch mean
    with pytest.raises(ConfigError, match="train.loss = 'user_code:nope': module user_code has no callable 'nope'"):
        check_job(load_config(None, [*FACTORY, "train.loss='user_code:nope'"]))
    with pytest.raises(ConfigError, match="train.eval_metrics are computed on the whole model's outputs"):
        cfg = load_config(None, [*FACTORY, "train.eval_metrics=['user_code:error_rate']", "parallel.pp=2"])
        check_user_code(cfg, Layout.from_config(cfg))


def test_table_errors_name_file_row_column_and_value(tmp_path):
    csv = _csv(tmp_path / "bad.csv", bad=(7, "n/a"))
    with pytest.raises(DataError) as e:
        check_job(load_config(None, [*TABLE, f"data.path='{csv}'", "data.target='price'"]))
    assert str(e.value) == (f"{csv}: row 7 (line 8), column 'c': 'n/a' is not a finite number; fix the cell or leave the "
                            "column out of data.features")
    good = _csv(tmp_path / "good.csv")
    with pytest.raises(DataError) as e:
        check_job(load_config(None, [*TABLE, f"data.path='{good}'", "data.target='y'"]))
    assert str(e.value) == f"{good} has no column 'y' (data.target); its columns: a, b, c, label, price"
    with pytest.raises(ConfigError, match="data.name = 'table' needs data.target"):
        check_job(load_config(None, [*TABLE, f"data.path='{good}'"]))



def test_plait_train_refuses_bad_user_data_in_one_line_with_exit_2(tmp_path, capsys):
    """The command line's own path (in this process): the launcher's checks, before any worker or run directory."""
    from plait.cli import main

    csv = _csv(tmp_path / "t.csv")
    for sets, message in ((["data.name=table", f"data.path={csv}", "data.target=y"],
                           f"error: {csv} has no column 'y' (data.target); its columns: a, b, c, label, price\n"),
                          (["data.factory=user_code:not_a_dataset"],
                           "error: data.factory = 'user_code:not_a_dataset' returned range_iterator, which has no")):
        args = [a for s in ["model.name=mlp", *sets] for a in ("--set", s)]
        assert main(["train", *args, "--out", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(message) and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "run").exists()
