"""train.target and launch.device_hour_cost: when a run first reaches a validation figure, on a fake clock and in a
dp=2 run resumed midway; the report's words and `plait runs compare`'s ranking."""

import json

import pytest

from helpers import rank0_params, tiny_gpt_config
from plait.config import load_config
from plait.errors import ConfigError
from plait.report.compare import compare_runs
from plait.report.html import human
from plait.train.job import check_job
from plait.train.target import TimeToTarget


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_the_first_evaluation_that_reaches_it_is_recorded_with_its_data_time_and_cost():
    clock, lines = Clock(), []
    t = TimeToTarget({"metric": "val_loss", "value": 2.0}, samples_per_step=32, tokens_per_sample=64, world_size=4,
                     device_hour_cost=3.0, log=lines.append, clock=clock)
    t.on_train_begin(0)
    clock.t += 90.0
    assert t.on_eval(10, {"val_loss": 2.5}) is None
    clock.t += 90.0
    d = t.on_eval(20, {"val_loss": 1.9})
    want = {"metric": "val_loss", "target": 2.0, "reached": True, "value": 1.9, "step": 20, "samples": 640,
            "wall_time_s": 180.0, "device_hours": 0.2, "tokens": 40960, "cost": pytest.approx(0.6)}
    assert d.events == ({"step": 20, "event": "target_reached", **want},) and not d.stop and not d.save
    assert lines == ["target reached: val_loss 1.9 <= 2 at step 20 (40,960 tokens, 180.0 s, 0.2 device-hours, cost 0.6)"]
    clock.t += 50.0
    assert t.on_eval(30, {"val_loss": 1.5}) is None  # only the first
    assert t.summary(40, {"val_loss": 1.4}) == {"time_to_target": want}


def test_a_resumed_run_adds_its_sessions_and_accuracy_counts_upwards():
    clock = Clock()
    first = TimeToTarget({"metric": "val_accuracy", "value": 0.9}, 16, None, world_size=2, clock=clock)
    first.on_train_begin(0)
    clock.t += 30.0
    assert first.on_eval(5, {"val_accuracy": 0.95, "val_loss": 0.3}) is not None
    state = first.state_dict()
    assert state["wall_s"] == 30.0 and state["device_s"] == 60.0

    second = TimeToTarget({"metric": "val_accuracy", "value": 0.97}, 16, None, world_size=4, clock=clock)
    second.load_state_dict({"wall_s": 30.0, "device_s": 60.0, "reached": None})  # a checkpoint before it was reached
    second.on_train_begin(5)
    clock.t += 10.0
    assert second.summary(8, {"val_accuracy": 0.96}) == {"time_to_target": {
        "metric": "val_accuracy", "target": 0.97, "reached": False, "steps": 8}}
    rec = second.on_eval(9, {"val_accuracy": 0.97}).events[0]
    assert (rec["wall_time_s"], rec["device_hours"], rec["samples"]) == (40.0, (60.0 + 40.0) / 3600, 144)
    assert "tokens" not in rec and "cost" not in rec  # not a language model; no price given


@pytest.mark.parametrize("sets, message", [
    (["train.target={value=2.0, metrc='val_loss'}"], "train.target has unknown keys ['metrc']; it takes metric and value"),
    (["train.target={metric='loss', value=2.0}"], "train.target.metric = 'loss': choose one of ['val_accuracy', 'val_loss']"),
    (["train.target={metric='val_loss'}"], "train.target.value = None must be a number, e.g. {metric = 'val_loss', "
                                           "value = 2.0}"),
    (["launch.device_hour_cost=-1"], "launch.device_hour_cost = -1.0 must be >= 0"),
])
def test_bad_targets_are_named(sets, message):
    with pytest.raises(ConfigError) as e:
        check_job(load_config(None, sets))
    assert str(e.value).startswith(message)


def test_words_for_the_report():
    reached = {"metric": "val_loss", "target": 2.0, "reached": True, "value": 1.9, "step": 1200, "samples": 38400,
               "wall_time_s": 185.0, "device_hours": 0.2056, "tokens": 4915200, "cost": 0.617}
    assert human("time_to_target", reached) == ("val_loss <= 2 at step 1,200: 3 min 5 s, 4,915,200 tokens, "
                                                "0.206 device-hours, cost 0.617")
    assert human("time_to_target", {"metric": "val_accuracy", "target": 0.9, "reached": False, "steps": 400}) == \
        "val_accuracy >= 0.9 not reached in 400 steps"


def _evaluations(run) -> list[tuple[int, float]]:
    return [(m["step"], m["val_loss"]) for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "val_loss" in m]


def test_a_dp2_run_resumed_midway_records_the_first_evaluation_at_the_target(pool2, tiny_text, tmp_path):
    sets = ("train.steps=12", "train.eval_every=2", "checkpoint.every=2", "train.target={value=TARGET}",
            "launch.device_hour_cost=2.5", "checkpoint.keep=10", "optim.name=sgd", "optim.momentum=0", "optim.lr=0.5",
            "optim.warmup_steps=0", "optim.schedule=constant")
    ref = tmp_path / "ref"
    pool2.run(rank0_params, tiny_gpt_config(tiny_text, *(s.replace("TARGET", "0.0") for s in sets)), ref)
    evals = _evaluations(ref)
    assert json.loads((ref / "summary.json").read_text())["time_to_target"] == {
        "metric": "val_loss", "target": 0.0, "reached": False, "steps": 12}
    target = round((evals[3][1] + evals[2][1]) / 2, 6)  # between the 3rd and 4th evaluations (steps 6 and 8)
    first = next(step for step, v in evals if v <= target)
    assert first > 4, evals  # reached in the second session

    run = tmp_path / "run"
    cfg = [s.replace("TARGET", str(target)) for s in sets]
    pool2.run(rank0_params, tiny_gpt_config(tiny_text, *cfg, "train.stop_after=4"), run)
    pool2.run(rank0_params, tiny_gpt_config(tiny_text, *cfg), run, True)
    summary = json.loads((run / "summary.json").read_text())
    got = summary["time_to_target"]
    assert _evaluations(run) == evals  # the same trajectory as the run without a break
    assert (got["step"], got["reached"], got["value"]) == (first, True, dict(evals)[first])
    assert got["samples"] == first * 8 and got["tokens"] == first * 8 * 32  # TINY_GPT: 8 samples of 32 tokens a step
    session1 = json.loads((run / "checkpoints" / "step_0000004" / "trainer_state.json").read_text())
    assert got["wall_time_s"] > session1["callbacks"]["target"]["wall_s"] > 0  # both sessions counted
    assert got["device_hours"] == pytest.approx(2 * got["wall_time_s"] / 3600)  # 2 processes in each session
    assert got["cost"] == pytest.approx(2.5 * got["device_hours"])
    assert summary["cost"] == pytest.approx(2.5 * summary["device_hours"])
    event = [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if m.get("event") ==
             "target_reached"]
    assert event == [{"step": first, "event": "target_reached", **got}]

    page = compare_runs([ref, run], tmp_path / "cmp").read_text()
    assert page.index("<th>run</th>") < page.index(f"val_loss &lt;= {target:g} at step {first}") < page.index(
        "val_loss &lt;= 0 not reached in 12 steps")  # the run that reached it first
