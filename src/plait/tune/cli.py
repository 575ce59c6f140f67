"""`plait tune CONFIG --space SPACE.toml --trials N ...`: a hyperparameter search of real plait runs.

    plait tune job.toml --space space.toml --trials 20 --concurrency 2 --metric val_loss --direction minimize \
        --pruner asha --out runs/tune [--storage sqlite:///tune.db]
"""

from __future__ import annotations

from pathlib import Path

from plait.errors import ConfigError
from plait.extras import install_command
from plait.rundir import timestamped


def cmd_tune(a) -> int:
    from plait.tune.pareto import parse_objectives, table  # lazily, with the rest of plait tune
    from plait.tune.space import read_space  # lazily: plait --help must not import torch or Optuna
    from plait.tune.study import PRUNERS, TuneOptions, Tuner, check_options  # lazily: plait --help must not import torch or Optuna

    try:
        import optuna  # noqa: F401
    except ImportError:
        raise ConfigError(f"plait tune uses Optuna: {install_command('tune')}") from None
    if a.pruner not in PRUNERS:
        raise ConfigError(f"--pruner {a.pruner!r}: choose one of {', '.join(PRUNERS)}")
    opts = TuneOptions(a.config, a.set, read_space(a.space), a.trials, a.concurrency, a.metric, a.direction,
                       a.pruner, a.storage, a.seed, a.eval_every,
                       objectives=parse_objectives(a.objectives) if a.objectives else None, warm=not a.no_warm)
    check_options(opts)
    out = Path(a.out) if a.out else timestamped("tune")
    s = Tuner(opts, out).run()
    if s.get("pareto"):
        print(f"the Pareto front ({len(s['pareto'])} of {s['complete']} complete trials):")
        print(table(s["pareto"], list(s["objectives"])))
        print(f"wrote {out / 'summary.json'}, {out / 'trials.csv'}, {out / 'report.html'}")
        return 0
    if s["best_trial"] is None:
        print(f"no trial completed ({s['pruned']} pruned, {s['failed']} failed); see {out / 'trials.csv'}")
        return 1
    params = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in s["best_params"].items())
    print(f"best: trial {s['best_trial']}, {s['metric']} {s['best_value']:.4f} with {params}")
    print(f"{s['complete']} complete, {s['pruned']} pruned, {s['failed']} failed; {s['steps_run']:,} steps run of "
          f"{s['steps_without_pruning']:,} without pruning")
    print(f"wrote {out / 'summary.json'}, {out / 'trials.csv'}, {out / 'report.html'}; the best run is {out / 'best'}")
    return 0


def add_parsers(sub, bench) -> None:
    t = sub.add_parser("tune", help="hyperparameter search: real plait runs, Optuna's samplers and pruners")
    t.add_argument("config", nargs="?", help="the job to tune (default: the built-in default job)")
    t.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="fixed overrides for every trial")
    t.add_argument("--space", type=Path, required=True,
                   help="TOML: each key's distribution, e.g. optim.lr = {log_uniform = [1e-4, 1e-2]}")
    t.add_argument("--trials", type=int, required=True, help="trials in the study (a re-run runs what is missing)")
    t.add_argument("--concurrency", type=int, default=1, help="trials at once, each with its processes (default 1)")
    t.add_argument("--metric", default="val_loss", help="the validation figure to optimise (default val_loss)")
    t.add_argument("--direction", default="minimize", choices=["minimize", "maximize"],
                   help="minimize (a loss) or maximize (an accuracy); default minimize")
    t.add_argument("--objectives", metavar="NAME:DIR,NAME:DIR",
                   help="a multi-objective search over summary.json figures, e.g. val_loss:minimize,params:minimize "
                        "(architecture search with model keys in --space); prints the Pareto front")
    t.add_argument("--pruner", default="asha", help="asha (successive halving), hyperband, median or none (default asha)")
    t.add_argument("--eval-every", type=int, default=0,
                   help="steps between validation figures the pruner sees (default: train.eval_every, or steps/10)")
    t.add_argument("--seed", type=int, default=0, help="the sampler's seed (default 0)")
    t.add_argument("--no-warm", action="store_true",
                   help="every trial a new plait train process (default: a one-process trial is forked ready to train "
                        "from a warm interpreter, about 2 s less a trial)")
    t.add_argument("--storage", help="an Optuna database URL for a study shared across machines "
                                     "(default: DIR/study.journal)")
    t.add_argument("--out", help="the study's folder: trials/, summary.json, trials.csv, report.html, best "
                                 "(default runs/tune-<time>)")
    t.set_defaults(fn=cmd_tune)
