"""Hyperparameter search over real `plait train` runs, with Optuna underneath.

Every trial draws its values from the space, runs `plait train CONFIG --set KEY=VALUE ... --out DIR/trials/NNNN`
(its own processes, at the config's layout; a one-process trial is forked ready to train from a warm interpreter,
plait.tune.warm, with the same run dir) and reports each validation figure it logs (every
`train.eval_every` steps) to the study; when the pruner says the trial cannot beat the others, the run gets
SIGTERM — plait's preemption: it checkpoints and exits 0 — and the trial is pruned. A run that fails is recorded
as a failed trial, with its log, and the study goes on.

The study lives in DIR/study.journal (Optuna's journal file: several `plait tune` processes, on one machine or on
a shared file system, can work on one study, and a re-run continues it) or in the database `--storage` names.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from plait.config import load_config
from plait.errors import ConfigError, PlaitError
from plait.launch import forkserver
from plait.tune.pareto import front, worse_than_median
from plait.tune.report import write_report
from plait.tune.space import Dim, as_override
from plait.tune.warm import WarmTrial, applies, can_fork

PRUNERS = ("asha", "hyperband", "median", "none")


class _Ended:
    """A trial refused before it started (its values make a job plait train refuses): exited with that code."""

    def __init__(self, code: int):
        self.returncode = code

    def poll(self) -> int:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        pass

    def wait(self) -> int:
        return self.returncode


class TrialFailed(RuntimeError):
    """A trial's run exited with an error (recorded as a failed trial; the study goes on)."""


@dataclass
class TuneOptions:
    config: str | None
    sets: list[str]
    dims: list[Dim]
    trials: int
    concurrency: int = 1
    metric: str = "val_loss"
    direction: str = "minimize"
    pruner: str = "asha"
    storage: str | None = None
    seed: int = 0
    eval_every: int = 0  # 0: the config's train.eval_every, or steps / 10 when that is 0
    poll: float = 0.3
    env: dict | None = None
    objectives: list[tuple[str, str]] | None = None  # --objectives: a multi-objective study (plait.tune.pareto)
    warm: bool = True  # one-process trials fork from a warm interpreter (plait.tune.warm); False: plait train each

    @property
    def multi(self) -> bool:
        return bool(self.objectives)


def _pruner(name: str, eval_every: int, steps: int):
    import optuna

    if name == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=eval_every, reduction_factor=3)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=eval_every, max_resource=steps, reduction_factor=3)
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=eval_every)
    return optuna.pruners.NopPruner()


def _alive(driver: str) -> bool:
    host, _, pid = driver.rpartition(":")
    if host != socket.gethostname():
        return True  # another machine's driver: not ours to judge
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError):
        return False
    except PermissionError:
        return True
    return True


def _storage(out: Path, url: str | None):
    import optuna

    if url:
        return optuna.storages.get_storage(url)
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    return JournalStorage(JournalFileBackend(str(out / "study.journal")))


def _val_lines(metrics: Path, metric: str, offset: int) -> tuple[list[tuple[int, float]], int]:
    """(step, value) of the metric in metrics.jsonl lines after byte `offset`; the new offset (whole lines only)."""
    if not metrics.is_file():
        return [], offset
    with metrics.open("rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    found = []
    for line in data[:end].splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if metric in row and "step" in row:
            found.append((int(row["step"]), float(row[metric])))
    return found, offset + end


def _last_step(metrics: Path) -> int:
    found, _ = _val_lines(metrics, "step", 0)
    return max((s for s, _ in found), default=0)


class Tuner:
    def __init__(self, opts: TuneOptions, out: Path):

        self.o, self.out = opts, Path(out)
        cfg = load_config(opts.config, opts.sets)  # a typo in CONFIG or --set is said before any trial starts
        self.steps = cfg.train.steps
        every = cfg.train.eval_every if 0 < cfg.train.eval_every < self.steps else max(1, self.steps // 10)
        self.eval_every = opts.eval_every or every  # the pruner needs several figures per trial
        self.lock = threading.Lock()
        self.driver = f"{socket.gethostname()}:{os.getpid()}"

    def study(self):
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.out.mkdir(parents=True, exist_ok=True)
        storage = _storage(self.out, self.o.storage)
        name = self.out.resolve().name
        try:  # a re-run seeds its sampler past the trials already drawn: it must not draw them again
            done = len(optuna.load_study(study_name=name, storage=storage).trials)
        except KeyError:
            done = 0
        sampler = optuna.samplers.TPESampler(seed=self.o.seed + done,
                                             n_startup_trials=max(2, min(10, self.o.trials // 3)),
                                             constant_liar=self.o.concurrency > 1)
        goal = ({"directions": [d for _, d in self.o.objectives or ()]} if self.o.multi
                else {"direction": self.o.direction})
        study = optuna.create_study(study_name=name, storage=storage, sampler=sampler,
                                    pruner=_pruner(self.o.pruner, self.eval_every, self.steps), load_if_exists=True,
                                    **goal)
        from optuna.trial import TrialState

        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if not _alive(t.user_attrs.get("driver", "")):  # its driver died (killed, rebooted): not running any more
                storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
                print(f"trial {t.number}: its plait tune process is gone; marked failed", flush=True)
        return study

    def objective(self, trial) -> float:
        import optuna

        values = {d.key: d.suggest(trial) for d in self.o.dims}
        run = self.out / "trials" / f"{trial.number:04d}"
        log_path = self.out / "logs" / f"{trial.number:04d}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        trial.set_user_attr("run_dir", str(run))
        trial.set_user_attr("driver", self.driver)
        sets = [*self.o.sets, *(as_override(k, v) for k, v in values.items()),
                f"train.eval_every={self.eval_every}", "log.progress=false"]
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())
        with log_path.open("w") as log:
            p = self._start(trial, sets, run, log, log_path)
            offset, reported, pruned_at = 0, set(), None
            metric = self.o.objectives[0][0] if self.o.objectives else self.o.metric
            while True:
                done = p.poll() is not None
                found, offset = _val_lines(run / "metrics.jsonl", metric, offset)
                for step, value in found:
                    if step in reported or pruned_at is not None:
                        continue
                    reported.add(step)
                    if not done and step < self.steps and self._prune(trial, step, value):
                        p.send_signal(signal.SIGTERM)  # plait's preemption: a checkpoint, exit 0
                        pruned_at = step
                if done:
                    break
                time.sleep(self.o.poll)
            p.wait()
        summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
        trial.set_user_attr("steps", int(summary.get("steps") or _last_step(run / "metrics.jsonl")))
        if pruned_at is not None:  # stopped on the pruner's word (a run stopped while finishing may exit != 0)
            with self.lock:
                ran = trial.user_attrs["steps"]
                print(f"trial {trial.number}: {shown} -> pruned at step {pruned_at}"
                      + (f" (its run stopped at step {ran}, the next checkpoint)" if ran != pruned_at else ""), flush=True)
            raise optuna.TrialPruned()
        if p.returncode != 0:
            tail = log_path.read_text().strip().splitlines()[-1:] or ["(no output)"]
            trial.set_user_attr("error", tail[0][:300])
            with self.lock:
                print(f"trial {trial.number}: {shown} -> failed (exit code {p.returncode}): {tail[0][:200]}; "
                      f"log {log_path}", flush=True)
            raise TrialFailed(tail[0])
        names = [n for n, _ in self.o.objectives] if self.o.objectives else [self.o.metric]
        values = [summary.get(n) for n in names]
        for name, value in zip(names, values):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
                with self.lock:
                    print(f"trial {trial.number}: {shown} -> the run logged no {name}", flush=True)
                raise TrialFailed(f"summary.json of {run} has no {name}; choose among "
                                  f"{', '.join(k for k, v in summary.items() if isinstance(v, (int, float)))}")
        with self.lock:
            figures = ", ".join(f"{n} {v:.4g}" for n, v in zip(names, values))
            print(f"trial {trial.number}: {shown} -> {figures} ({summary.get('steps')} steps)", flush=True)
        return tuple(float(v) for v in values) if self.o.multi else float(values[0])

    def _start(self, trial, sets: list[str], run: Path, log, log_path: Path):
        """The trial's run: forked warm when it is one process here (plait.tune.warm), else `plait train`."""
        if self.o.warm:
            try:
                warm = can_fork() and applies(load_config(self.o.config, sets))
            except PlaitError:
                warm = False  # `plait train` says what is wrong with this trial's values, in its log
            if warm:
                try:
                    return WarmTrial(self.o.config, sets, run, log_path, self.o.env, f"tune-{trial.number}")
                except PlaitError as e:  # what `plait train` would have refused: the same line, a failed trial
                    print(f"error: {e}", file=log, flush=True)
                    return _Ended(getattr(e, "exit_code", 2))
        cmd = [sys.executable, "-m", "plait", "train", *([self.o.config] if self.o.config else []),
               *[a for s in sets for a in ("--set", s)], "--out", str(run)]
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.o.env, start_new_session=True)

    def _prune(self, trial, step: int, value: float) -> bool:
        """Whether the pruner stops this trial at this evaluation. A multi-objective study (which Optuna cannot
        prune) uses the median rule on its first objective over the finished trials' figures at the same step."""
        if not self.o.objectives:
            trial.report(value, step)
            return trial.should_prune()
        curve = {**trial.user_attrs.get("curve", {}), str(step): value}
        trial.set_user_attr("curve", curve)
        if self.o.pruner == "none":
            return False
        from optuna.trial import TrialState

        others = [t.user_attrs["curve"][str(step)] for t in trial.study.get_trials(deepcopy=False,
                                                                                     states=(TrialState.COMPLETE,))
                  if str(step) in t.user_attrs.get("curve", {})]
        return worse_than_median(value, others, self.o.objectives[0][1])

    def run(self) -> dict:
        from optuna.trial import TrialState

        study = self.study()
        finished = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
        have = len(study.get_trials(deepcopy=False, states=finished))
        todo = max(0, self.o.trials - have)
        print(f"plait tune: {todo} trials to run ({have} of {self.o.trials} done), {self.o.concurrency} at once, "
              f"pruner {self.o.pruner}, {self.o.metric} every {self.eval_every} steps; study in {self.out}",
              flush=True)
        if todo:
            try:
                study.optimize(self.objective, n_trials=todo, n_jobs=self.o.concurrency, catch=(TrialFailed,))
            finally:
                forkserver.stop()
        return self.finish(study)

    def _damaged(self, trial, attr: str, value) -> ConfigError:
        where = self.o.storage or str(self.out / "study.journal")
        return ConfigError(f"the study in {where}: trial {trial.number} has {attr} = {value!r}, which plait tune does "
                           "not write; the journal is damaged or another program's: start a new study (another --out "
                           "or --storage)")

    def _trial_steps(self, trial) -> int:
        value = trial.user_attrs.get("steps", 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self._damaged(trial, "steps", value)
        return value

    def finish(self, study) -> dict:
        from optuna.trial import TrialState

        trials = study.get_trials(deepcopy=False)
        count = {s: sum(t.state == s for t in trials) for s in (TrialState.COMPLETE, TrialState.PRUNED,
                                                                 TrialState.FAIL)}
        steps_run = sum(self._trial_steps(t) for t in trials)
        summary = {"metric": self.o.metric, "direction": self.o.direction, "pruner": self.o.pruner,
                   "trials": len(trials), "complete": count[TrialState.COMPLETE],
                   "pruned": count[TrialState.PRUNED], "failed": count[TrialState.FAIL],
                   "steps_run": steps_run, "steps_without_pruning": len(trials) * self.steps,
                   "best_value": None, "best_params": None, "best_trial": None, "best_run": None}
        if self.o.objectives:
            done = {t.number: t for t in trials if t.state == TrialState.COMPLETE}
            names, directions = [n for n, _ in self.o.objectives], [d for _, d in self.o.objectives]
            summary.update(metric=names[0], direction=directions[0], objectives=dict(self.o.objectives),
                           pareto=[{"trial": k, "values": done[k].values, "params": done[k].params,
                                    "run": done[k].user_attrs.get("run_dir")}
                                   for k in front({k: t.values for k, t in done.items()}, directions)])
        elif count[TrialState.COMPLETE]:
            best = study.best_trial
            summary.update(best_value=best.value, best_params=best.params, best_trial=best.number,
                           best_run=best.user_attrs.get("run_dir"))
            link = self.out / "best"
            if link.is_symlink() or link.exists():
                link.unlink()
            run_dir = best.user_attrs.get("run_dir")
            if not isinstance(run_dir, str) or not run_dir:
                raise self._damaged(best, "run_dir", run_dir)
            link.symlink_to(Path("trials") / Path(run_dir).name)  # inside the study's folder, whatever the journal says
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
        write_trials_csv(trials, self.out / "trials.csv")
        write_report(study, summary, self.out)
        return summary


def write_trials_csv(trials, path: Path) -> None:
    import csv

    keys = sorted({k for t in trials for k in t.params})
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["trial", "state", "value", *keys, "steps", "seconds", "run_dir", "error"])
        for t in trials:
            secs = (t.datetime_complete - t.datetime_start).total_seconds() if t.datetime_complete and \
                t.datetime_start else ""
            w.writerow([t.number, t.state.name.lower(), "" if t.values is None else " ".join(map(str, t.values)),
                        *[t.params.get(k, "") for k in keys], t.user_attrs.get("steps", ""),
                        f"{secs:.1f}" if secs != "" else "", t.user_attrs.get("run_dir", ""),
                        t.user_attrs.get("error", "")])


def check_options(o: TuneOptions) -> None:
    if o.trials < 1:
        raise ConfigError(f"--trials {o.trials}: run at least 1 trial")
    if o.concurrency < 1:
        raise ConfigError(f"--concurrency {o.concurrency}: run at least 1 trial at once")
    if o.pruner not in PRUNERS:
        raise ConfigError(f"--pruner {o.pruner!r}: choose one of {', '.join(PRUNERS)}")
    if o.direction not in ("minimize", "maximize"):
        raise ConfigError(f"--direction {o.direction!r}: choose minimize or maximize")
    if not o.metric.startswith("val_"):
        raise ConfigError(f"--metric {o.metric!r}: trials are compared on a validation figure (val_loss, "
                          f"val_accuracy, ...): the runs log them every train.eval_every steps")
