"""parallel.auto: the launcher chooses the layout for the processes it has within launch.device_memory, says why,
records it, trains on the one-process trajectory, and plans again when a resume has another process count."""

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import TINY_GPT, params_after, plait, tiny_gpt_config
from plait.api import export
from plait.config import load_config
from plait.errors import ConfigError
from plait.parallel.layout import Layout
from plait.plan.auto import choose

VOCAB = 60


def _cfg(*sets):
    return load_config(None, TINY_GPT + ["parallel.auto=true", *sets])


def test_a_memory_cap_that_rules_out_plain_data_parallel_gets_a_layout_that_fits():
    free = choose(_cfg("launch.nproc_per_node=2", "launch.device_memory=1GB"), VOCAB)
    assert (free.parallel.dp, free.parallel.tp, free.parallel.pp, free.parallel.cp) == (2, 1, 1, 1)  # dp is fastest
    tight = choose(_cfg("launch.nproc_per_node=2", "launch.device_memory=300KB"), VOCAB)
    lay = Layout.from_config(tight)
    assert lay.world_size == 2 and lay.dp < 2  # the cap leaves data parallel alone out
    assert tight.launch.on_resize == "replan" and tight.parallel.auto
    reason = tight.parallel.auto_reason
    assert reason.startswith(f"dp {lay.dp} x tp {lay.tp} x pp {lay.pp}")
    assert "layouts of 2 processes that fit 0.286 MiB per device" in reason
    assert reason.endswith("; data parallel alone (dp 2, no ZeRO) would need 0.52 MiB at least)")


@pytest.mark.parametrize("sets, message", [
    (["launch.nproc_per_node=2", "launch.device_memory=200KB"],
     "parallel.auto: no layout of 2 processes fits 0.191 MiB per device (the smallest, dp 1 x tp 1 x pp 1 x cp 2, "
     "ZeRO-2, micro-batch 1, needs 0.26 MiB); raise launch.device_memory or launch.nproc_per_node"),
    (["launch.device_memory=1GB"], "parallel.auto plans for the processes the job has: set launch.nproc_per_node "
                                   "(e.g. --set launch.nproc_per_node=4)"),
    (["launch.nproc_per_node=2", "model.name=mlp", "data.name=digits"],
     "parallel.auto plans GPTs (plait plan's model); model.name = 'mlp' is not one: set the layout yourself "
     "(parallel.dp, tp, pp, zero)"),
    (["launch.nproc_per_node=2", "launch.device_memory=lots"], "launch.device_memory = 'lots' is not a size; write "
                                                               "e.g. 80GB or 16GiB"),
])
def test_what_cannot_be_planned_is_named(sets, message):
    with pytest.raises(ConfigError) as e:
        choose(_cfg(*sets), VOCAB)
    assert str(e.value) == message


def _losses(run) -> dict[int, tuple[float, float]]:
    return {m["step"]: (m["loss"], m["grad_norm"]) for m in map(json.loads, (run / "metrics.jsonl").read_text()
                                                                  .splitlines()) if "loss" in m}


def test_an_auto_run_on_2_then_4_processes_keeps_the_one_process_trajectory(tiny_text, tmp_path):
    sgd = ["train.steps=6", "train.eval_every=0", "checkpoint.every=3", "optim.name=sgd", "optim.momentum=0",
           "optim.weight_decay=0", "optim.grad_clip=0", "optim.warmup_steps=0", "optim.schedule=constant", "optim.lr=0.3"]
    ref = params_after(tiny_gpt_config(tiny_text, *sgd, "parallel.dp=1"), tmp_path / "one")
    run = tmp_path / "auto"
    sets = [a for s in [*TINY_GPT, "data.name='text'", f"data.path='{tiny_text}'", *sgd, "parallel.auto=true",
                        "launch.nproc_per_node=2", "launch.device_memory=250KB", "train.stop_after=3"]
            for a in ("--set", s)]
    first = plait("train", *sets, "--out", run)
    assert first.returncode == 0, first.stdout + first.stderr
    chosen = load_config(run / "config.toml")
    assert f"parallel.auto: {chosen.parallel.auto_reason}" in first.stdout
    assert (chosen.parallel.dp, chosen.parallel.zero) == (2, 2)  # 250 KB: data parallel alone (no ZeRO) does not fit
    assert chosen.parallel.auto_reason.endswith("data parallel alone (dp 2, no ZeRO) would need 0.34 MiB at least)")
    again = plait("train", "--resume", run, "--set", "launch.nproc_per_node=4", "--set", "launch.device_memory=150KB",
                  "--set", "train.stop_after=0")
    assert again.returncode == 0, again.stdout + again.stderr
    now = load_config(run / "config.toml")
    assert Layout.from_config(now).world_size == 4 and now.parallel.auto_reason != chosen.parallel.auto_reason
    assert (now.parallel.dp, now.parallel.cp, now.parallel.zero) == (2, 2, 2)  # 150 KB on 4: context parallel too
    summary = json.loads((run / "summary.json").read_text())
    assert summary["auto_layout"] == now.parallel.auto_reason and summary["world_size"] == 4
    want = _losses(tmp_path / "one")
    got = _losses(run)
    assert sorted(got) == sorted(want) == list(range(1, 7))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-4, abs=1e-5), step
    export(run, tmp_path / "m.safetensors")  # in this process (`plait export` as a process: the README block)
    weights = load_file(str(tmp_path / "m.safetensors"))
    assert max((weights[k] - ref[k]).abs().max().item() for k in ref) < 1e-4
    assert all(torch.isfinite(v).all() for v in weights.values())
