"""plait whatif: the dependency graph of a traced step, its replay, and each change against arithmetic done by hand
on a trace written here (tests/plan/test_plan.py replays a real one)."""

from __future__ import annotations

import json

import pytest

from plait.errors import ConfigError
from plait.plan.whatif import Step, apply, parse_change, predict, simulate

MAIN, COMM = 7, 9


def op(name: str, ts: float, dur: float, tid: int = MAIN) -> dict:
    return {"ph": "X", "pid": 1, "tid": tid, "name": name, "ts": ts, "dur": dur}


def trace(tmp_path, events: list[dict]):
    run = tmp_path / "run"
    (run / "traces").mkdir(parents=True)
    (run / "traces" / "rank0.json").write_text(json.dumps({"traceEvents": events}))
    (run / "config.toml").write_text("[parallel]\ndp = 2\n")
    return run


# One DDP step (microseconds): forward 0-100 (the model 10-90), backward 110-200 whose second function issues a
# 100-long all-reduce at 160 (ends 260), the main thread idle 200-260 then resuming 5 later, clipping, the
# optimizer step 300-380 (four 15-long kernels with 5 between), zero_grad.
STEP = [
    op("aten::to", 0, 5), op("DistributedDataParallel.forward", 10, 80), op("aten::detach", 12, 1),
    op("aten::cross_entropy_loss", 92, 8),
    op("autograd::engine::evaluate_function: AddmmBackward0", 110, 40),
    op("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 152, 48),
    op("c10d::allreduce_", 160, 2), op("gloo:all_reduce", 160, 100, tid=COMM),
    op("aten::_foreach_norm", 265, 20), op("aten::detach", 286, 1),
    op("Optimizer.step#AdamW.step", 300, 80), *[op("aten::add_", 300 + 20 * k, 15) for k in range(4)],
    op("Optimizer.zero_grad#AdamW.zero_grad", 385, 5),
]


def test_the_graph_replays_the_traced_step_exactly(tmp_path):
    (step,) = Step.from_trace(trace(tmp_path, STEP) / "traces" / "rank0.json")
    assert [t.phase for t in step.tasks] == ["forward"] * 3 + ["backward"] * 2 + ["optimizer"] * 4
    norm = step.tasks[5]
    assert norm.name == "aten::_foreach_norm" and norm.waits == [0] and norm.resume == 5 and norm.gap == 5
    assert step.comms[0].issuer == 4 and step.comms[0].offset == 8 and step.trivial == 1
    assert step.tasks[7].children == [15, 15, 15, 15]
    assert simulate(step) == 390.0


@pytest.mark.parametrize("change, want", [
    ("allreduce=2x", 390 - 50),  # the all-reduce ends at 210; the clip starts 5 later
    ("compression=fp16", 390 - 50),
    ("fuse_optimizer", 390 - 80 + (1 + 4 * 14)),  # one dispatch and four kernels' work without theirs
    ("checkpointing", 390 + 80),  # the model's forward again, before backward
    # ZeRO-1: backward ends at 200; reduce-scatter 50 (to 250); clip from 255 to 275, detach; the step over half
    # the parameters (40) from 290 to 330; all-gather 50 (to 380) while zero_grad runs 335-340: the step ends at 380
    ("zero=1", 380),
])
def test_each_change_against_the_arithmetic(tmp_path, change, want):
    (step,) = Step.from_trace(trace(tmp_path, STEP) / "traces" / "rank0.json")
    assert simulate(apply(step, change, dp=2)) == pytest.approx(want)
    assert simulate(step) == 390.0  # the change made a copy


def test_predictions_scale_the_traced_step(tmp_path):
    run = trace(tmp_path, STEP)
    got = predict(run, ["allreduce=2x", "checkpointing"])
    assert got["traced_step_s"] == pytest.approx(390e-6) and got["dp"] == 2 and got["steps"] == 1
    assert got["changes"]["allreduce=2x"]["ratio"] == pytest.approx(340 / 390)
    assert got["changes"]["checkpointing"]["predicted_s"] == pytest.approx(470e-6)


def test_bad_changes_and_missing_traces_say_what_to_do(tmp_path):
    with pytest.raises(ConfigError) as e:
        parse_change("allreduce=fast")
    assert str(e.value) == ("--change 'allreduce=fast' is not a change plait can simulate; use one of allreduce=<F>x, "
                            "compression=fp16, compression=bf16, zero=1, fuse_optimizer, checkpointing")
    with pytest.raises(ConfigError) as e:
        predict(tmp_path, ["zero=1"])
    assert str(e.value) == (f"{tmp_path}/traces/rank0.json is missing: train with --set log.profile_steps=[5,5] (a step "
                            "after warm-up) to record the trace plait whatif reads")
    one = [e for e in STEP if e["tid"] == MAIN]  # one process: nothing to shard
    (step,) = Step.from_trace(trace(tmp_path / "one", one) / "traces" / "rank0.json")
    with pytest.raises(ConfigError, match=r"--change zero=1 replaces DDP's all-reduces; this trace has none"):
        apply(step, "zero=1", 2)
