"""The pipeline bubble plait reports, and what it is made of, at p = 2 for GPipe and 1F1B.

bubble = theory + imbalance + fixed cost (plait.parallel.pipeline.pipeline_summary): the theory's
(p - 1) / (m + p - 1) for equal slots; the recorded schedule replayed with its measured slot lengths and no
other cost, less the theory (unequal slots); and the measured bubble less that replay (time between slots:
sends, receives, the schedule's Python). Nothing here is timed: the checks are exact facts about the recorded
slots (the order is the textbook schedule's, the parts add up, the replay is a lower bound, the summary is the
recorded steps'). How close the measured bubble comes to the theory with compute-bound micro-batches is a
measurement: benchmarks/pipeline_bubble.py.
"""

from __future__ import annotations

import json

import pytest

from helpers import TINY_GPT
from plait.config import load_config
from plait.parallel.pipeline import pipeline_summary, replay_span, step_bubble

P = 2
MICROBATCHES = (2, 4, 8)
SCHEDULES = ("gpipe", "1f1b")
STEPS = 3  # step 1 builds the schedule (shape inference, buffers): left out, as plait's own figures do


def recorded_run(cfg, run_dir):
    """Pool task: train; the summary and this rank's slots per step, recorded beside plait's own record."""
    from plait.parallel import pipeline
    from plait.train.trainer import train

    steps = []
    record_step = pipeline.PipelineStrategy._record_step

    def record(self, t0, span):
        steps.append(list(self.events))
        record_step(self, t0, span)

    pipeline.PipelineStrategy._record_step = record
    try:
        summary = train(cfg, run_dir).summary
    finally:
        pipeline.PipelineStrategy._record_step = record_step
    return summary, steps


@pytest.fixture(scope="module")
def runs(pool2, tiny_text, tmp_path_factory):
    """{(schedule, m): (summary, [events per pp rank for each step after the first], run dir)}."""
    out = {}
    for schedule in SCHEDULES:
        for m in MICROBATCHES:
            cfg = load_config(None, [*TINY_GPT, "data.name='text'", f"data.path='{tiny_text}'", "parallel.dp=1",
                                     f"parallel.pp={P}", f"parallel.pp_schedule='{schedule}'", "train.micro_batch_size=1",
                                     f"train.global_batch_size={m}", f"train.steps={STEPS}", "optim.name='sgd'",
                                     "optim.momentum=0", "log.every=100", "checkpoint.every=0"])
            # one run writes its run directory (summary.json, the timeline plot); the others skip the checkpoint
            run = tmp_path_factory.mktemp("bubble") / "run" if (schedule, m) == ("1f1b", 4) else None
            results = pool2.run(recorded_run, cfg, run)
            summary = json.loads((run / "summary.json").read_text()) if run else results[0][0]
            per_step = [[steps[k] for _, steps in results] for k in range(1, STEPS)]
            out[schedule, m] = summary, per_step, run
    return out


def theory(m: int) -> float:
    return (P - 1) / (m + P - 1)


def bubble_of(events, durations=None) -> float:
    """1 - mean busy / span, as recorded (durations None) or replayed with equal slots."""
    if durations is None:
        span, busy = step_bubble(events)
        return 1 - busy / span
    busy = sum(sum(durations[e[1]] for e in ev) for ev in events) / len(events)
    return 1 - busy / replay_span(events, durations)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_recorded_schedule_has_the_theorys_bubble(runs, schedule):
    """Replayed with equal slots (forward 1, backward 2), the recorded order is the textbook schedule's: exactly."""
    for m in MICROBATCHES:
        summary, per_step, _ = runs[schedule, m]
        assert summary["pipeline"]["bubble_fraction_theory"] == pytest.approx(theory(m))
        for events in per_step:
            assert bubble_of(events, {"F": 1.0, "B": 2.0}) == pytest.approx(theory(m), abs=1e-12)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_bubble_is_theory_plus_unequal_slots_plus_fixed_cost(runs, schedule):
    """Each part against its own definition, computed here from the recorded slots; then the parts against the
    measured bubble, also computed here (the summary's three parts add up by construction, so only parts checked
    one by one against the slots can catch one of them computed wrong)."""
    for m in MICROBATCHES:
        summary, per_step, _ = runs[schedule, m]
        p = summary["pipeline"]
        assert p["steps_measured"] == len(per_step) == STEPS - 1
        measured = sum(bubble_of(ev) for ev in per_step) / len(per_step)
        # the recorded order with the recorded slot lengths and nothing between slots
        replayed = sum(1 - step_bubble(ev)[1] / replay_span(ev) for ev in per_step) / len(per_step)
        between = sum(step_bubble(ev)[0] - replay_span(ev) for ev in per_step) / len(per_step)
        assert p["bubble_fraction_theory"] == pytest.approx(theory(m), abs=1e-12)
        assert p["imbalance_fraction"] == pytest.approx(replayed - theory(m), abs=1e-12), (schedule, m, p)
        assert p["fixed_cost_fraction"] == pytest.approx(measured - replayed, abs=1e-12), (schedule, m, p)
        parts = p["bubble_fraction_theory"] + p["imbalance_fraction"] + p["fixed_cost_fraction"]
        assert parts == pytest.approx(measured, abs=1e-12)
        # the replay starts every slot as soon as its input and its rank allow: a lower bound on the measured span
        assert between >= -1e-9 and p["fixed_cost_fraction"] >= -1e-6, (schedule, m, p)
        assert p["fixed_cost_ms_per_microbatch"] == pytest.approx(1000 * between / m, abs=1e-9), (schedule, m, p)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_reported_bubble_is_the_recorded_steps(runs, schedule):
    for m in MICROBATCHES:
        summary, per_step, _ = runs[schedule, m]
        p = summary["pipeline"]
        measured = [bubble_of(events) for events in per_step]
        assert p["bubble_fraction"] == pytest.approx(sum(measured) / len(measured), abs=1e-12)
        replayed = [1 - step_bubble(ev)[1] / replay_span(ev) for ev in per_step]
        assert p["fixed_cost_fraction"] == pytest.approx((sum(measured) - sum(replayed)) / len(per_step), abs=1e-12)


def gpipe_2x2(hop: float) -> list[dict]:
    """GPipe, 2 stages, 2 micro-batches, forward 1 s and backward 2 s, each stage-to-stage hop costing `hop`."""
    f0 = [(0, "F", 0, 0.0, 1.0), (0, "F", 1, 1.0, 2.0)]
    s1 = 1.0 + hop
    f1 = [(1, "F", 0, s1, s1 + 1), (1, "F", 1, s1 + 1, s1 + 2), (1, "B", 0, s1 + 2, s1 + 4), (1, "B", 1, s1 + 4, s1 + 6)]
    b0 = s1 + 4 + hop
    stage0 = f0 + [(0, "B", 0, b0, b0 + 2), (0, "B", 1, b0 + 2, b0 + 4)]
    return [{"pp_rank": 0, "step_events": [stage0], "peak_inflight": 2},
            {"pp_rank": 1, "step_events": [f1], "peak_inflight": 2}]


def test_a_cost_between_stages_is_fixed_cost_not_schedule():
    ideal = pipeline_summary(gpipe_2x2(0.0), "gpipe", 2, 2, 1)
    assert ideal["bubble_fraction"] == pytest.approx(1 / 3) == pytest.approx(ideal["bubble_fraction_theory"])
    assert ideal["imbalance_fraction"] == pytest.approx(0.0, abs=1e-12)
    assert ideal["fixed_cost_fraction"] == pytest.approx(0.0, abs=1e-12)
    # two hops of 0.5 s on the critical path: span 10 s instead of 9, busy 6 s per stage
    slow = pipeline_summary(gpipe_2x2(0.5), "gpipe", 2, 2, 1)
    assert slow["bubble_fraction"] == pytest.approx(1 - 6 / 10)
    assert slow["imbalance_fraction"] == pytest.approx(0.0, abs=1e-12)
    assert slow["fixed_cost_fraction"] == pytest.approx(1 - 6 / 10 - 1 / 3)
    assert slow["fixed_cost_ms_per_microbatch"] == pytest.approx(1000 * (10 - 9) / 2)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_micro_batches_in_flight(runs, schedule):
    # GPipe holds every micro-batch's activations on the first stage; 1F1B at most p.
    for m in MICROBATCHES:
        assert runs[schedule, m][0]["pipeline"]["peak_inflight_per_rank"][0] == (m if schedule == "gpipe" else P)


def test_the_timeline_is_drawn(runs):
    assert (runs["1f1b", 4][2] / "pipeline.png").stat().st_size > 10_000
