"""What `plait tune` does (its parser: plait.tune.cli): the study's options checked, the trials run, the best (or
the Pareto front) printed. Imported when the verb runs; Optuna itself is imported by the study as it starts.
"""

from __future__ import annotations

from pathlib import Path

from plait.errors import ConfigError
from plait.extras import install_command
from plait.rundir import timestamped
from plait.tune.pareto import parse_objectives, table
from plait.tune.space import read_space
from plait.tune.study import PRUNERS, TuneOptions, Tuner, check_options


def cmd_tune(a) -> int:
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
