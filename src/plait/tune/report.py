"""DIR/report.html of a `plait tune` study: the best trial, every trial, and Optuna's own plots (optimisation
history, intermediate values with the pruned trials, parameter importance)."""

from __future__ import annotations

import html
import warnings
from pathlib import Path

from plait.report.html import STYLE
from plait.report.plots import plt

MIN_FOR_IMPORTANCE = 3  # finished trials before parameter importance means anything


def _plots(study, out: Path) -> list[tuple[str, str]]:
    import optuna.visualization.matplotlib as ovm
    from optuna.trial import TrialState

    made = []
    finished = sum(t.state == TrialState.COMPLETE for t in study.trials)
    for name, title, fn in (("history.png", "optimisation history", ovm.plot_optimization_history),
                            ("intermediate.png", "validation figure during each trial (pruned trials stop early)",
                             ovm.plot_intermediate_values),
                            ("importance.png", "parameter importance (fANOVA)", ovm.plot_param_importances),
                            ("pareto.png", "the Pareto front (the trials no other beats on every objective)",
                             ovm.plot_pareto_front)):
        if (name == "pareto.png") != (len(study.directions) > 1):
            continue
        if name == "importance.png" and finished < MIN_FOR_IMPORTANCE:
            continue  # fANOVA over one or two finished trials ranks noise
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
                ax = fn(study)
            fig = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
            fig.set_size_inches(7, 4)
            fig.tight_layout()
            fig.savefig(out / name, dpi=110)
            plt.close(fig)
            made.append((name, title))
        except (ValueError, RuntimeError, ZeroDivisionError):
            pass  # too few finished trials for this plot
    return made


def write_report(study, summary: dict, out: Path) -> Path:
    from optuna.trial import TrialState

    rows = [("metric", f"{summary['metric']} ({summary['direction']})"), ("pruner", summary["pruner"]),
            ("trials", f"{summary['trials']}: {summary['complete']} complete, {summary['pruned']} pruned, "
                       f"{summary['failed']} failed"),
            ("steps run", f"{summary['steps_run']:,} of {summary['steps_without_pruning']:,} without pruning"
                          + (f" ({1 - summary['steps_run'] / summary['steps_without_pruning']:.0%} saved)"
                             if summary["steps_without_pruning"] else ""))]
    if summary.get("pareto") is not None:
        names = list(summary["objectives"])
        rows.append(("objectives", ", ".join(f"{n} ({d})" for n, d in summary["objectives"].items())))
        rows += [(f"Pareto trial {p['trial']}", ", ".join(f"{n} {v:.4g}" for n, v in zip(names, p["values"])) + "; "
                  + ", ".join(f"{k} = {v:.4g}" if isinstance(v, float) else f"{k} = {v}" for k, v in p["params"].items()))
                 for p in summary["pareto"]]
    if summary["best_trial"] is not None:
        rows += [("best value", f"{summary['best_value']:.4f} (trial {summary['best_trial']})"),
                 ("best parameters", ", ".join(f"{k} = {v:.4g}" if isinstance(v, float) else f"{k} = {v}"
                                               for k, v in summary["best_params"].items())),
                 ("best run", f"<a href=\"best/report.html\">best/</a> ({html.escape(summary['best_run'])})")]
    trials = study.get_trials(deepcopy=False)
    keys = sorted({k for t in trials for k in t.params})
    body = [f"<h1>plait tune: {html.escape(out.resolve().name)}</h1>", "<table>"]
    body += [f"<tr><th>{k}</th><td>{v if k == 'best run' else html.escape(str(v))}</td></tr>" for k, v in rows]
    body.append("</table>")
    for name, title in _plots(study, out):
        body.append(f"<h2>{html.escape(title)}</h2><img src=\"{name}\" alt=\"{html.escape(title)}\">")
    body.append("<h2>trials</h2><table><tr><th>trial</th><th>state</th><th>value</th>"
                + "".join(f"<th>{html.escape(k)}</th>" for k in keys) + "<th>steps</th></tr>")
    for t in trials:
        value = "" if t.values is None else " / ".join(f"{v:.4g}" for v in t.values)
        state = t.state.name.lower() + (f": {html.escape(t.user_attrs['error'])}" if t.state == TrialState.FAIL
                                        and t.user_attrs.get("error") else "")
        cells = "".join(f"<td class=n>{t.params[k]:.4g}</td>" if isinstance(t.params.get(k), float) else
                        f"<td>{html.escape(str(t.params.get(k, '')))}</td>" for k in keys)
        body.append(f"<tr><td class=n>{t.number}</td><td>{state}</td><td class=n>{value}</td>{cells}"
                    f"<td class=n>{t.user_attrs.get('steps', '')}</td></tr>")
    body.append("</table>")
    page = out / "report.html"
    page.write_text(f"<!doctype html><html><head><meta charset=utf-8><title>plait tune</title><style>{STYLE}</style>"
                    f"</head><body>{''.join(body)}</body></html>")
    return page
