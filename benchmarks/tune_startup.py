"""Per-trial start-up: the same 8-trial learning-rate study under plait tune (warm trials), plait tune --no-warm
(every trial a `plait train` process), Ray Tune and plain Optuna, each timed as a user waits for it (one process
from start to end, its imports included).

Every side runs the same trial: plait's trainer on the same job (an MLP on digits, 60 steps, evaluation and
checkpoint at the end), 8 trials one at a time, no pruning, the learning rate drawn log-uniformly from [0.01, 3]:

    plait tune          `plait tune ... --trials 8 --pruner none`: one-process trials forked from a warm interpreter
    plait tune --no-warm  the same, each trial a new `plait train` process (launcher, torchrun's agent, a worker)
    Ray Tune            a Ray Tune Tuner (local Ray, 2 CPUs) whose function trainable runs the trial's job with
                        plait's trainer in its (reused) Ray worker: plait.launch.job.run_worker
    Optuna              plain Optuna in one process, the objective calling run_worker the same way

Runs alternate `--repeats` times; wall seconds min / median / max, and each side's ratio to Ray Tune's median.
The issue's target: plait tune <= Ray Tune.

    python benchmarks/tune_startup.py [--repeats 3] [--trials 8] [--steps 60]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def job(steps: int) -> list[str]:
    return ["model.name=mlp", "data.name=digits", "model.width=64", "parallel.dp=1", f"train.steps={steps}",
            "train.global_batch_size=32", "train.micro_batch_size=32", "train.eval_samples=256",
            "log.progress=false", "log.report=false", "optim.name=sgd", "optim.momentum=0"]


# one trial in this process: the job checked as plait train checks it, then plait's trainer (no launcher)
TRIAL = textwrap.dedent("""
    import json, os
    from pathlib import Path
    from plait.config import load_config
    from plait.launch.env import resolve
    from plait.launch.job import run_worker
    from plait.train.job import check_job

    def trial(sets, lr, run):
        cfg = load_config(None, [*sets, f"optim.lr={lr}"])
        check_job(cfg)
        run_worker(cfg, Path(run), env=resolve({}))
        return json.loads((Path(run) / "summary.json").read_text())["val_loss"]
""")

RAY = TRIAL + textwrap.dedent("""
    import sys, ray
    from ray import tune
    sets, trials, out = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)

    def trainable(config):
        run = f"{out}/runs/{tune.get_context().get_trial_id()}"
        tune.report({"val_loss": trial(sets, config["lr"], run)})

    tuner = tune.Tuner(trainable, param_space={"lr": tune.loguniform(0.01, 3.0)},
                       tune_config=tune.TuneConfig(num_samples=trials, max_concurrent_trials=1, metric="val_loss",
                                                   mode="min", reuse_actors=True),
                       run_config=tune.RunConfig(storage_path=f"{out}/ray", verbose=0))
    best = tuner.fit().get_best_result()
    print("best", best.config["lr"], best.metrics["val_loss"])
""")

OPTUNA = TRIAL + textwrap.dedent("""
    import sys, optuna
    sets, trials, out = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0))
    study.optimize(lambda t: trial(sets, t.suggest_float("lr", 0.01, 3.0, log=True), f"{out}/runs/{t.number}"),
                   n_trials=trials)
    print("best", study.best_params["lr"], study.best_value)
""")


def side_commands(name: str, tmp: Path, trials: int, steps: int) -> list[str]:
    import json

    sets = job(steps)
    if name.startswith("plait"):
        (tmp / "space.toml").write_text("optim.lr = {log_uniform = [0.01, 3.0]}\n")
        return [str(BIN / "plait"), "tune", *[a for s in sets for a in ("--set", s)], "--space", str(tmp / "space.toml"),
                "--trials", str(trials), "--pruner", "none", "--out", str(tmp / "study"),
                *(["--no-warm"] if name.endswith("--no-warm") else [])]
    script = tmp / f"{name.replace(' ', '_')}.py"
    script.write_text(RAY if name == "Ray Tune" else OPTUNA)
    return [sys.executable, str(script), json.dumps(sets), str(trials), str(tmp)]


def run_side(name: str, trials: int, steps: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        cmd = side_commands(name, Path(d), trials, steps)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "RAY_DEDUP_LOGS": "0"}
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=d, timeout=900)
        wall = time.perf_counter() - t0
        if r.returncode != 0:
            raise SystemExit(f"{name} failed (exit {r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
        return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--sides", default="plait tune,plait tune --no-warm,Ray Tune,Optuna")
    a = ap.parse_args()
    sides = a.sides.split(",")
    walls: dict[str, list[float]] = {s: [] for s in sides}
    print(f"load average {os.getloadavg()[0]:.2f}; {a.trials} trials of {a.steps} steps, {a.repeats} repeats")
    for r in range(a.repeats):
        for s in sides:
            walls[s].append(run_side(s, a.trials, a.steps))
            print(f"  repeat {r + 1}: {s:<22} {walls[s][-1]:6.1f} s", flush=True)
    base = statistics.median(walls["Ray Tune"]) if "Ray Tune" in walls else None
    print("\n| side | wall s min / median / max | trials per minute (median) | / Ray Tune |")
    print("|---|---:|---:|---:|")
    for s, w in walls.items():
        med = statistics.median(w)
        ratio = f"{med / base:.2f}" if base else "-"
        print(f"| {s} | {min(w):.1f} / {med:.1f} / {max(w):.1f} | {60 * a.trials / med:.1f} | {ratio} |")
    print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
