"""`plait tune CONFIG --space SPACE.toml --trials N ...`: a hyperparameter search of real plait runs.

    plait tune job.toml --space space.toml --trials 20 --concurrency 2 --metric val_loss --direction minimize \
        --pruner asha --out runs/tune [--storage sqlite:///tune.db]

The parser only; the study runs in plait.tune.commands (Optuna's samplers and pruners, the trials' launcher).
"""

from __future__ import annotations

from pathlib import Path


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
    t.set_defaults(fn="plait.tune.commands:cmd_tune")
