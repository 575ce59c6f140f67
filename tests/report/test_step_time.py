"""The step-time bars use the bottleneck report's categories (communication and bubble included) and leave out the
warm-up window, so the picture and the verdict beside it say the same."""

import pytest

from plait.report import plots
from plait.report.bottleneck import row_split, split

ROWS = [  # step 1 is its own window (start-up), then windows of 10 steps; seconds per step
    {"step": 1, "step_time_s": 2.0, "time": {"data": 0.01, "forward_backward": 1.9, "optimizer": 0.05}, "comm_wait_s": 0.1},
    {"step": 10, "step_time_s": 0.10, "time": {"data": 0.01, "forward_backward": 0.07, "optimizer": 0.01},
     "comm_wait_s": 0.03},
    {"step": 20, "step_time_s": 0.12, "time": {"data": 0.01, "forward_backward": 0.08, "optimizer": 0.02},
     "comm_wait_s": 0.05},
]


def test_a_window_splits_into_the_reports_categories_and_sums_to_its_step():
    got = row_split(ROWS[1], bubble_fraction=0.25)
    # bubble: a quarter of forward-backward; the wait beyond it is exposed communication; the rest of fb computes
    assert got == pytest.approx({"data": 0.01, "compute": 0.07 - 0.0175 - 0.0125, "exposed_comm": 0.0125,
                                 "bubble": 0.0175, "optimizer": 0.01, "other": 0.01})
    assert sum(got.values()) == pytest.approx(ROWS[1]["step_time_s"])
    # a wait that is all bubble (a stage idling in its receives) is not counted twice
    assert split(1.0, 0.0, 0.8, 0.1, 0.3, 0.5)["exposed_comm"] == 0.0


def test_the_bars_show_communication_and_bubble_and_leave_out_warm_up(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(plots, "save", lambda fig, out: seen.setdefault("fig", fig) and out)
    plots.step_time_breakdown(ROWS, tmp_path / "step_time.png", bubble_fraction=0.25)
    ax = seen["fig"].axes[0]
    labels = ax.get_legend_handles_labels()[1]
    assert labels == ["data", "compute", "communication (exposed)", "pipeline bubble", "optimizer", "other"]
    assert ax.get_title() == "where each step's time goes (warm-up window to step 1 left out)"
    # two bars per category (steps 10 and 20): the 2-second start-up window is not drawn
    tops = {}
    for container in ax.containers:
        for bar in container:
            x = round(bar.get_x() + bar.get_width() / 2)
            tops[x] = max(tops.get(x, 0.0), bar.get_y() + bar.get_height())
    assert sorted(tops) == [10, 20]
    assert tops[10] == pytest.approx(100.0) and tops[20] == pytest.approx(120.0)  # each stack is its step, in ms
