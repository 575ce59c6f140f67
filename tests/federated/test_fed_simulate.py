"""`plait fed simulate` end to end: FedAvg on digits reaches 90 %, the run directory, comparisons, secure = plain."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fed_helpers import fed_config
from plait.cli import main
from plait.errors import ConfigError
from plait.federated.simulate import simulate


@pytest.mark.slow
def test_fedavg_on_digits_10_clients_dirichlet_reaches_90_percent_within_30_rounds(tmp_path, capsys):
    # Prepare: no config at all: the documented default job (FedAvg, MLP, digits, 10 clients, Dirichlet 0.5, seed 1234).
    out = tmp_path / "run"
    # Execute
    assert main(["fed", "simulate", "--out", str(out)]) == 0
    # Assert
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy"] == "fedavg" and summary["rounds"] == 30 and summary["clients"] == 10
    assert summary["partition"] == "dirichlet" and summary["alpha"] == 0.5
    assert summary["test_accuracy"] >= 0.90
    assert summary["rounds_to_90"] is not None and summary["rounds_to_90"] <= 30
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == list(range(1, 31))
    assert all({"test_accuracy", "test_loss", "clients", "train_loss"} <= set(r) and r["clients"] == 10 for r in records)
    assert records[0]["test_accuracy"] < 0.5 < records[-1]["test_accuracy"]  # it learned in these rounds
    first_hit = next(r["round"] for r in records if r["test_accuracy"] >= 0.9)
    assert summary["rounds_to_90"] == first_hit
    # the report and its plots
    page = (out / "report.html").read_text()
    assert 'src="accuracy.png"' in page and 'src="labels.png"' in page
    assert (out / "accuracy.png").stat().st_size > 1000 and (out / "labels.png").stat().st_size > 1000
    hist = np.array(json.loads((out / "partition.json").read_text())["label_counts"])
    assert hist.shape == (10, 10) and hist.sum() == 1618  # digits: 1797 samples, 10 % held out
    # the saved global model scores what the summary says on the held-out set
    from plait.data import build_data
    from plait.models import build_model

    cfg = fed_config()
    bundle = build_data(cfg.data, cfg.model)
    model = build_model(cfg.model, bundle.spec)
    model.load_state_dict(load_file(out / "model.safetensors"))
    x, y = bundle.val.fetch(torch.arange(len(bundle.val)))
    with torch.no_grad():
        acc = int((model(x).argmax(-1) == y).sum()) / len(y)
    assert acc == pytest.approx(summary["test_accuracy"], abs=1e-9)
    assert f"; 90 % test accuracy reached at round {summary['rounds_to_90']}" in capsys.readouterr().out


def test_a_run_that_never_reaches_90_percent_says_so_in_words():
    from plait.federated.simulate import reached_90

    assert reached_90(None, 3) == "90 % test accuracy not reached in 3 rounds"
    assert reached_90(7, 30) == "90 % test accuracy reached at round 7"


def test_compare_writes_one_run_per_strategy_and_a_combined_report(tmp_path):
    out = tmp_path / "cmp"
    assert main(["fed", "simulate", "--compare", "fedavg,fedsgd,fedprox", "--rounds", "3", "--clients", "4",
                 "--set", "federated.local_epochs=1", "--set", "federated.local_lr=0.1", "--set", "federated.stop_at_accuracy=0.99",
                 "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["strategies"]) == ["fedavg", "fedsgd", "fedprox"]
    for name in ("fedavg", "fedsgd", "fedprox"):
        assert json.loads((out / name / "summary.json").read_text())["strategy"] == name
        assert len((out / name / "metrics.jsonl").read_text().splitlines()) == 3
    # one local epoch of SGD beats one gradient step after 3 rounds
    acc = {n: s["test_accuracy"] for n, s in summary["strategies"].items()}
    assert acc["fedavg"] > acc["fedsgd"] + 0.1
    page = (out / "report.html").read_text()
    assert 'src="accuracy.png"' in page and "fedsgd/report.html" in page
    # human units: no strategy reached 90 % in 3 rounds, so no ratio is given against a missing figure
    assert all(s["rounds_to_90"] is None for s in summary["strategies"].values())
    assert not any(k.endswith("_over_fedavg_rounds") for k in summary) and "x FedAvg" not in page
    assert page.count("<td>not reached in 3 rounds</td>") == 3
    assert f"<td>{100 * acc['fedavg']:.1f} %</td>" in page and "None" not in page
    run_page = (out / "fedavg" / "report.html").read_text()
    assert "<th>final test accuracy</th>" in run_page and "<th>rounds to 90 % test accuracy</th>" in run_page
    assert "rounds_to_90" not in run_page and "None" not in run_page


def test_report_figures_read_in_human_units_and_ratios_need_both_figures():
    from plait.federated.report import human, ratio_line, rounds_ratios

    summary = {"rounds": 30, "test_accuracy": 0.608939, "wall_time_s": 12.345, "secure_aggregation": False}
    assert human("test_accuracy", 0.608939, summary) == "60.9 %"
    assert human("rounds_to_90", None, summary) == "not reached in 30 rounds"
    assert human("rounds_to_90", 12, summary) == "12"
    assert human("wall_time_s", 12.345, summary) == "12.3 s"
    assert human("secure_aggregation", False, summary) == "off"
    assert human("test_loss", None, summary) == "n/a"
    table = {"fedavg": {"rounds_to_90": 15}, "fedprox": {"rounds_to_90": 12}, "fedsgd": {"rounds_to_90": None}}
    assert rounds_ratios(table) == {"fedprox_over_fedavg_rounds": 0.8}
    assert ratio_line("fedprox", table) == "fedprox reached 90 % in 0.80x FedAvg's rounds (12 vs 15)"
    assert rounds_ratios({"fedavg": {"rounds_to_90": None}, "fedprox": {"rounds_to_90": 12}}) == {}


def test_secure_aggregation_with_dropouts_gives_the_plain_runs_model(tmp_path):
    # Prepare: 6 clients, 30 % drop out mid-round (after masking); the same seeds with and without masks.
    common = ["federated.rounds=3", "federated.clients=6", "federated.sim_dropout=0.3", "federated.local_epochs=1",
              "federated.min_clients=2", "log.report=false"]
    # Execute
    plain = simulate(fed_config(*common), tmp_path / "plain", log=None)
    secure = simulate(fed_config(*common, "federated.secure_aggregation=true"), tmp_path / "secure", log=None)
    # Assert: the same clients dropped, and the masked rounds (with recovery) give the same model up to fixed point.
    rec = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
           for name in ("plain", "secure")}
    assert [r["dropped"] for r in rec["plain"]] == [r["dropped"] for r in rec["secure"]]
    assert any(r["dropped"] for r in rec["secure"]) and not any(r.get("skipped") for r in rec["secure"])
    a, b = load_file(tmp_path / "plain" / "model.safetensors"), load_file(tmp_path / "secure" / "model.safetensors")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    assert plain["test_accuracy"] == pytest.approx(secure["test_accuracy"], abs=0.02)


@pytest.mark.parametrize("aggregator", ["median", "trimmed_mean"])
def test_robust_aggregators_train_in_simulation(aggregator):
    summary = simulate(fed_config("federated.rounds=3", "federated.clients=5", f"federated.aggregator='{aggregator}'",
                                  "federated.partition='iid'", "federated.local_epochs=1", "federated.trim_fraction=0.2"),
                       None, log=None)
    assert summary["aggregator"] == aggregator and summary["test_accuracy"] > 0.4  # from 0.1 (chance); mean gets 0.56


@pytest.mark.parametrize("args, message", [
    (["--strategy", "fedfoo"], "federated.strategy = 'fedfoo' is not one of: fedavg, fedprox, fedadam, fedsgd"),
    (["--compare", "fedavg,bogus"], "--compare 'fedavg,bogus': strategies must be among"),
    (["--set", "federated.secure_aggregation=true", "--set", "federated.aggregator='median'"],
     "needs each update in the clear"),
    (["--set", "federated.clients_per_round=2.5"], "must be a whole number"),
    (["--set", "federated.partition='shards'", "--set", "federated.shards_per_client=200"], "shards"),
])
def test_user_errors_exit_2_in_one_line(tmp_path, capsys, args, message):
    assert main(["fed", "simulate", *args, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1


def test_a_federated_run_exports_serves_and_reports_like_a_training_run(tmp_path):
    from plait.export import load_exported

    out = tmp_path / "f"
    assert main(["fed", "simulate", "--rounds", "2", "--clients", "4", "--set", "federated.local_epochs=1",
                 "--out", str(out)]) == 0
    page = (out / "report.html").read_text()
    model, meta = load_exported(out / "model.safetensors")  # what `plait serve RUN/model.safetensors` loads
    assert meta["plait.federated"] == "fedavg"
    assert torch.equal(model.state_dict()[next(iter(model.state_dict()))],
                       load_file(out / "model.safetensors")[next(iter(model.state_dict()))])
    assert main(["export", str(out), "-o", str(tmp_path / "m.safetensors")]) == 0
    assert load_file(tmp_path / "m.safetensors").keys() == load_file(out / "model.safetensors").keys()
    assert main(["report", str(out)]) == 0
    assert (out / "report.html").read_text() == page  # the federated report, not "no steps were logged"
    from plait.serve.model.load import ModelRef, load_model

    served = load_model(ModelRef(str(out)))  # plait serve RUN: the final global model, not "train it first"
    assert torch.equal(next(iter(served.module.state_dict().values())), next(iter(model.state_dict().values())))
    summary = (out / "summary.json").read_text()
    with pytest.raises(ConfigError, match=f"--resume {out}: that is a federated run \\(plait fed\\), which keeps no "):
        from plait.launch.start import start_run

        start_run(None, [], resume=out)
    assert (out / "summary.json").read_text() == summary  # nothing trained into it, nothing overwritten
