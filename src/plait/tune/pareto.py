"""`plait tune --objectives val_loss:minimize,params:minimize`: a multi-objective search (architecture search when
the space holds model keys: model.layers, model.width, model.heads, ...), DLS ch. 11's AutoML.

Each trial is scored on several figures of its summary.json (any number it records: val_loss, val_accuracy,
params, train_time_s, tokens_per_s, ...); Optuna's TPE sampler draws from the space by all of them (its
multi-objective mode), and the study's answer is the Pareto front: the trials no other trial beats on every
objective. Optuna cannot prune a multi-objective trial; plait prunes on the first objective, which must be a
validation figure, by the median rule: a trial whose figure at an evaluation step is worse than the median of
the finished trials' at that step (at least two of them) is stopped.
"""

from __future__ import annotations

import statistics

from plait.errors import ConfigError


def parse_objectives(text: str) -> list[tuple[str, str]]:
    """'val_loss:minimize,params:minimize' -> [('val_loss', 'minimize'), ('params', 'minimize')]."""
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, direction = part.partition(":")
        if direction not in ("minimize", "maximize") or not name:
            raise ConfigError(f"--objectives {text!r}: write NAME:minimize or NAME:maximize, comma-separated, e.g. "
                              "val_loss:minimize,params:minimize")
        out.append((name, direction))
    if len(out) < 2:
        raise ConfigError(f"--objectives {text!r} names {len(out)} objective; give two or more (one: --metric)")
    if not out[0][0].startswith("val_"):
        raise ConfigError(f"--objectives: the first objective ({out[0][0]}) is the one trials are pruned on and must "
                          "be a validation figure (val_loss, val_accuracy, ...)")
    if len({n for n, _ in out}) != len(out):
        raise ConfigError(f"--objectives {text!r} names an objective twice")
    return out


def worse_than_median(value: float, others: list[float], direction: str) -> bool:
    """The median pruning rule on one objective: at least two finished trials, and this value worse than their median."""
    if len(others) < 2:
        return False
    m = statistics.median(others)
    return value > m if direction == "minimize" else value < m


def dominates(a: list[float], b: list[float], directions: list[str]) -> bool:
    """a is at least as good as b on every objective and better on one."""
    sign = [1 if d == "minimize" else -1 for d in directions]
    pairs = [(s * x, s * y) for s, x, y in zip(sign, a, b)]
    return all(x <= y for x, y in pairs) and any(x < y for x, y in pairs)


def front(points: dict[int, list[float]], directions: list[str]) -> list[int]:
    """The keys of the non-dominated points, in key order."""
    return [k for k, v in points.items() if not any(dominates(w, v, directions) for j, w in points.items() if j != k)]


def table(rows: list[dict], names: list[str]) -> str:
    head = f"{'trial':>5}  " + "  ".join(f"{n:>14}" for n in names) + "  parameters"
    lines = [head]
    for r in rows:
        params = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r["params"].items())
        lines.append(f"{r['trial']:>5}  " + "  ".join(f"{v:>14.6g}" for v in r["values"]) + f"  {params}")
    return "\n".join(lines)
