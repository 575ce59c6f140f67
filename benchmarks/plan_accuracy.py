"""How right is `plait plan`? Predicted vs measured step time and per-rank memory for every layout this
machine can run (1, 2 and 4 processes) on the default GPT and a larger one.

For each process count, each layout trains a few steps through plait's own trainer (gloo ranks
from plait.testing) and its summary and metrics are compared with the prediction from this
machine's calibration (`plait plan --calibrate`, on the same ranks). The machine may be shared
and its load come and go over minutes, so the work goes in `--repeats` rounds, each a calibration
followed by one run of every layout: the profile is the median of the rounds' calibrations, a
layout's step time the median of all its post-warm-up steps (the spread of the runs' own medians
is printed next to it), and a burst of load elsewhere falls on both sides alike.
Targets: memory within 10 %, step time within 20 %, and the planner's top choice the fastest
measured layout of its group, or as fast as it in at least one round (the rounds do not agree which
of the two is faster: the measurement cannot order them).

    python benchmarks/plan_accuracy.py [--steps 8] [--repeats 2] [--models default,large] [--worlds 1,2,4]

runs/plan_accuracy.json keeps every row with the measured phase times (forward_backward, optimizer,
data, communication wait and bytes per step) next to the predicted terms and the profile they came
from, to find what a miss is.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path

from plait.config import load_config
from plait.parallel.layout import Layout
from plait.plan.calibrate import calibrate
from plait.plan.cost import Hardware, predict
from plait.plan.memory import Shape
from plait.testing import RankPool

MODELS = {"default": [], "large": ["model.layers=8", "model.width=256", "model.heads=8"]}
LAYOUTS = {
    1: [Layout(dp=1, micro_batch=16), Layout(dp=1, micro_batch=16, activation_checkpointing=True)],
    2: [Layout(dp=2, micro_batch=16), Layout(dp=2, zero=1, micro_batch=16), Layout(dp=2, zero=2, micro_batch=16),
        Layout(dp=2, zero=3, micro_batch=16), Layout(pp=2, micro_batch=4, schedule="gpipe"), Layout(pp=2, micro_batch=4),
        Layout(pp=2, micro_batch=4, schedule="interleaved-1f1b", virtual_stages=2), Layout(tp=2, micro_batch=16),
        Layout(tp=2, micro_batch=16, sequence_parallel=True)],
    4: [Layout(dp=4, micro_batch=8), Layout(dp=2, pp=2, micro_batch=4), Layout(dp=2, tp=2, micro_batch=16),
        Layout(pp=2, tp=2, micro_batch=4),
        Layout(pp=4, micro_batch=4), Layout(dp=2, tp=2, zero=3, micro_batch=16)],
}
WARMUP = 2  # steps left out of the median (the first steps allocate, connect and warm caches)


def overrides(layout: Layout) -> list[str]:
    return [s.strip() for s in layout.sets().split("--set ")[1:]]


def median_profile(profiles: list[Hardware]) -> Hardware:
    """The median of each measured figure over calibrations taken between the rounds of runs."""

    def med(values):
        if isinstance(values[0], dict):
            return {k: med([v[k] for v in values]) for k in values[0]}
        if isinstance(values[0], list):
            return [med([v[i] for v in values]) for i in range(len(values[0]))]
        if isinstance(values[0], (int, float)) and not isinstance(values[0], bool):
            return statistics.median(values)
        return values[0]

    return Hardware(**med([asdict(p) for p in profiles]))


def run(cfg, run_dir: str):
    """Pool task: train; rank 0 returns (post-warm-up step times, per-rank memory, median phase times)."""
    import torch.distributed as dist

    from plait.train.trainer import train

    s = train(cfg, run_dir).summary
    if dist.get_rank() != 0:
        return None
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_time_s" in r and r["step"] > WARMUP]
    med = lambda f: statistics.median(f(r) for r in rows)  # noqa: E731
    phases = {k: med(lambda r, k=k: r["time"].get(k, 0.0)) for k in rows[0]["time"]}
    phases |= {"comm_wait_s": med(lambda r: r["comm_wait_s"]), "comm_bytes": med(lambda r: r["comm_bytes"])}
    return [r["step_time_s"] for r in rows], s["memory"]["per_rank"], phases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="rounds: a calibration, then every layout once")
    ap.add_argument("--models", default="default,large")
    ap.add_argument("--worlds", default="1,2,4")
    a = ap.parse_args()
    base = ["train.global_batch_size=32", "log.every=1", "log.progress=false", "log.report=false",
            "train.sample_tokens=0", "train.eval_samples=16", "checkpoint.every=0", f"train.steps={a.steps}"]
    results, choices = [], []
    for name in a.models.split(","):
        for world in map(int, a.worlds.split(",")):
            cfg0 = load_config(None, base + MODELS[name])  # the model only: calibrate() takes the world
            shape = Shape.from_config(cfg0.model, 114)
            layouts = LAYOUTS[world]
            cfgs = [load_config(None, base + MODELS[name] + overrides(lay) + ["model.vocab_size=114"]) for lay in layouts]
            times: list[list[float]] = [[] for _ in layouts]
            medians: list[list[float]] = [[] for _ in layouts]
            phases: list[list[dict]] = [[] for _ in layouts]
            mems: list = [None] * len(layouts)
            profiles = []
            with RankPool(world, timeout_s=900) as pool, tempfile.TemporaryDirectory() as tmp:
                for rep in range(a.repeats):
                    profiles.append(calibrate(cfg0.model, 114, 16, world, pool=pool))
                    for i, cfg in enumerate(cfgs):
                        steps, mems[i], ph = pool.run(run, cfg, f"{tmp}/{rep}-{i}")[0]
                        times[i] += steps
                        medians[i].append(statistics.median(steps))
                        phases[i].append(ph)
            hw = median_profile(profiles)
            print(f"\n{name} GPT ({shape.params / 1e6:.2f}M), {world} process(es): {hw.flops / 1e9:.1f} GFLOP/s per "
                  f"process, efficiency {hw.efficiency:.2f} (medians of {len(profiles)} calibrations)", flush=True)
            rows = []
            for i, lay in enumerate(layouts):
                step = statistics.median(times[i])
                pred, mem = predict(shape, lay, 32, hw), mems[i]
                state = max(m["params_bytes"] + m["grads_bytes"] + m["optimizer_bytes"] for m in mem)
                pstate = max(r["params"] + r["grads"] + r["optimizer"] for r in pred["memory"]["per_pp_rank"])
                act = max(m["activations_peak_bytes"] for m in mem)
                pact = max(r["activations_per_microbatch"] for r in pred["memory"]["per_pp_rank"])
                spread = (max(medians[i]) - min(medians[i])) / step
                row = {"model": name, "world": world, "layout": lay.label(), "step_measured": step, "spread": spread,
                       "run_medians": medians[i], "step_predicted": pred["time"]["step_s"],
                       "predicted_terms": {k: v for k, v in pred["time"].items() if k != "mfu"},
                       "phases_measured": {k: statistics.median(p[k] for p in phases[i]) for k in phases[i][0]},
                       "state_measured": state, "state_predicted": pstate, "act_measured": act, "act_predicted": pact,
                       "profile": asdict(hw)}
                rows.append(row)
                print(f"  {lay.label():38} step {step * 1000:7.1f} ms ±{spread / 2:4.0%}, predicted "
                      f"{row['step_predicted'] * 1000:7.1f} ({row['step_predicted'] / step - 1:+4.0%});  model state "
                      f"{state / 2**20:6.2f} MiB ({pstate / state - 1:+.1%});  activations {act / 2**20:6.2f} MiB "
                      f"({pact / act - 1:+.1%})", flush=True)
            best_pred = min(rows, key=lambda r: r["step_predicted"])
            fastest = min(rows, key=lambda r: r["step_measured"])
            gap = best_pred["step_measured"] / fastest["step_measured"] - 1
            # a tie: in some round the choice's median was no slower than the fastest's
            wins = sum(b <= f for b, f in zip(best_pred["run_medians"], fastest["run_medians"]))
            met = best_pred is fastest or wins > 0
            choices.append(met)
            rounds = f"as fast in {wins} of {len(fastest['run_medians'])} rounds"
            print(f"  planner's choice {best_pred['layout']}: {best_pred['step_measured'] * 1000:.1f} ms measured; fastest "
                  f"{fastest['layout']}: {fastest['step_measured'] * 1000:.1f} ms ({gap:+.1%}"
                  f"{'' if best_pred is fastest else ', ' + rounds})", flush=True)
            results += rows
    within = lambda key, tol: sum(abs(r[f"{key}_predicted"] / r[f"{key}_measured"] - 1) <= tol for r in results)  # noqa: E731
    n = len(results)
    print(f"\nmodel state within 10 %: {within('state', 0.10)}/{n}; activations within 10 %: {within('act', 0.10)}/{n}; "
          f"step time within 20 %: {within('step', 0.20)}/{n} (within 25 %: {within('step', 0.25)}/{n}); "
          f"planner's choice the fastest: {sum(choices)}/{len(choices)} groups")
    Path("runs").mkdir(exist_ok=True)
    Path("runs/plan_accuracy.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
