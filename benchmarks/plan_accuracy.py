"""How right is `plait plan`? Predicted vs measured step time and per-rank memory for every layout this
machine can run (1, 2 and 4 processes) on the default GPT and a larger one.

For each process count the machine is calibrated first (`plait plan --calibrate`, in the same
session, so that the same load is in both), then each layout trains a few steps through plait's
own trainer (gloo ranks from plait.testing) and its summary and metrics are compared with the
prediction. Targets: memory within 10 %, step time within 25 %, and the planner's top choice
within 10 % of the fastest measured layout.

    python benchmarks/plan_accuracy.py [--steps 6] [--models default,large] [--worlds 1,2,4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from plait.config import load_config
from plait.plan.calibrate import calibrate
from plait.plan.cost import predict
from plait.plan.memory import Layout, Shape
from plait.testing import RankPool

MODELS = {"default": [], "large": ["model.layers=8", "model.width=256", "model.heads=8"]}
LAYOUTS = {
    1: [Layout(dp=1, micro=16), Layout(dp=1, micro=16, ac=True)],
    2: [Layout(dp=2, micro=16), Layout(dp=2, zero=1, micro=16), Layout(dp=2, zero=2, micro=16),
        Layout(dp=2, zero=3, micro=16), Layout(pp=2, micro=4, schedule="gpipe"), Layout(pp=2, micro=4),
        Layout(pp=2, micro=4, schedule="interleaved-1f1b", virtual=2), Layout(tp=2, micro=16),
        Layout(tp=2, micro=16, sp=True)],
    4: [Layout(dp=4, micro=8), Layout(dp=2, pp=2, micro=4), Layout(dp=2, tp=2, micro=16), Layout(pp=2, tp=2, micro=4),
        Layout(pp=4, micro=4), Layout(dp=2, tp=2, zero=3, micro=16)],
}


def overrides(layout: Layout) -> list[str]:
    return [s.strip() for s in layout.sets().split("--set ")[1:]]


def run(cfg, run_dir: str):
    """Pool task: train; rank 0 returns (median step time after warm-up, per-rank memory)."""
    import torch.distributed as dist

    from plait.train.trainer import train

    s = train(cfg, run_dir).summary
    if dist.get_rank() != 0:
        return None
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r and r["step"] > 2]
    return statistics.median(times), s["memory"]["per_rank"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--models", default="default,large")
    ap.add_argument("--worlds", default="1,2,4")
    a = ap.parse_args()
    base = ["train.global_batch_size=32", "log.every=1", "log.progress=false", "log.report=false",
            "train.sample_tokens=0", "train.eval_samples=16", "checkpoint.every=0", f"train.steps={a.steps}"]
    results = []
    for name in a.models.split(","):
        for world in map(int, a.worlds.split(",")):
            cfg0 = load_config(None, base + MODELS[name])  # the model only: calibrate() takes the world
            shape = Shape.from_config(cfg0.model, 114)
            hw = calibrate(cfg0.model, 114, 16, world)
            print(f"\n{name} GPT ({shape.params / 1e6:.2f}M), {world} process(es): {hw.flops / 1e9:.1f} GFLOP/s per "
                  f"process, efficiency {hw.efficiency:.2f}", flush=True)
            rows = []
            with RankPool(world, timeout_s=900) as pool, tempfile.TemporaryDirectory() as tmp:
                for i, lay in enumerate(LAYOUTS[world]):
                    cfg = load_config(None, base + MODELS[name] + overrides(lay) + ["model.vocab_size=114"])
                    step, mem = pool.run(run, cfg, f"{tmp}/{i}")[0]
                    pred = predict(shape, lay, 32, hw)
                    state = max(m["params_bytes"] + m["grads_bytes"] + m["optimizer_bytes"] for m in mem)
                    pstate = max(r["params"] + r["grads"] + r["optimizer"] for r in pred["memory"]["per_pp_rank"])
                    act = max(m["activations_peak_bytes"] for m in mem)
                    pact = max(r["activations_per_microbatch"] for r in pred["memory"]["per_pp_rank"])
                    row = {"model": name, "world": world, "layout": lay.label(), "step_measured": step,
                           "step_predicted": pred["time"]["step_s"], "state_measured": state, "state_predicted": pstate,
                           "act_measured": act, "act_predicted": pact}
                    rows.append(row)
                    print(f"  {lay.label():34} step {step * 1000:7.1f} ms, predicted {row['step_predicted'] * 1000:7.1f} "
                          f"({row['step_predicted'] / step - 1:+.0%});  model state {state / 2**20:6.2f} MiB "
                          f"({pstate / state - 1:+.1%});  activations {act / 2**20:6.2f} MiB ({pact / act - 1:+.1%})",
                          flush=True)
            best_pred = min(rows, key=lambda r: r["step_predicted"])
            fastest = min(rows, key=lambda r: r["step_measured"])
            print(f"  planner's choice {best_pred['layout']}: {best_pred['step_measured'] * 1000:.1f} ms measured; fastest "
                  f"{fastest['layout']}: {fastest['step_measured'] * 1000:.1f} ms "
                  f"({best_pred['step_measured'] / fastest['step_measured'] - 1:+.0%})")
            results += rows
    within = lambda key, tol: sum(abs(r[f"{key}_predicted"] / r[f"{key}_measured"] - 1) <= tol for r in results)  # noqa: E731
    n = len(results)
    print(f"\nmodel state within 10 %: {within('state', 0.10)}/{n}; activations within 10 %: {within('act', 0.10)}/{n}; "
          f"step time within 25 %: {within('step', 0.25)}/{n}")
    Path("runs").mkdir(exist_ok=True)
    Path("runs/plan_accuracy.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
