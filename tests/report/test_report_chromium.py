"""Every HTML page plait writes, opened in headless Chromium: it renders, every <img> loads (naturalWidth > 0) and its
visible text holds no raw Python dict or list. The pages: a training run's report.html (and `plait report`), `plait runs
compare`, a federated run's report and a federated comparison (`plait fed simulate --compare`), `plait data audit`,
`plait tune`'s study report.

A probe script appended to a copy of each page writes the images' natural widths and document.body.innerText into the
DOM that `chromium --headless --dump-dom` prints. Debian's chromium is installed by .ci/run; elsewhere the test skips.
"""

import html
import importlib.util
import json
import re
import shutil
import subprocess

import pytest
import torch

from plait.cli import main

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs a headless Chromium: apt-get install chromium (.ci/run does)")

PROBE = """<script>window.addEventListener("load", () => {
  const r = {imgs: [...document.images].map(i => [i.getAttribute("src"), i.naturalWidth]), text: document.body.innerText};
  const p = document.createElement("pre"); p.id = "plait-probe"; p.textContent = JSON.stringify(r);
  document.body.appendChild(p);
});</script>"""

RAW = re.compile(r"\{'|\{\"|': |\[\(|\[\[")  # a dict's or a nested list's repr leaking into the page


def render(page) -> dict:
    """{"imgs": [[src, naturalWidth], ...], "text": visible text} of the page as Chromium renders it."""
    probe = page.with_name(f"_probe_{page.name}")  # beside the page, so its relative images resolve
    source = page.read_text()
    assert "</body>" in source, page
    probe.write_text(source.replace("</body>", PROBE + "</body>", 1))
    try:
        r = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--mute-audio",
                            "--allow-file-access-from-files", "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
                           capture_output=True, text=True, timeout=60)
    finally:
        probe.unlink()
    m = re.search(r'<pre id="plait-probe">(.*?)</pre>', r.stdout, re.S)
    assert m, f"{page}: Chromium did not render it (rc {r.returncode}): {r.stderr[-2000:]}"
    return json.loads(html.unescape(m.group(1)))


@pytest.fixture(scope="module")
def pages(tracked_run, tmp_path_factory):
    """(name, path) of every kind of page, each written by plait itself."""
    root = tmp_path_factory.mktemp("pages")
    run = tracked_run[0]
    shutil.copytree(run, root / "run2", ignore=shutil.ignore_patterns("mlruns", "wandb", "checkpoints"))
    assert main(["report", str(run)]) == 0
    assert main(["runs", "compare", str(run), str(root / "run2"), "--out", str(root / "cmp")]) == 0
    fed = ["--set", "federated.clients=2", "--set", "federated.local_epochs=1", "--rounds", "1"]
    assert main(["fed", "simulate", *fed, "--compare", "fedavg,fedsgd", "--out", str(root / "fed")]) == 0
    g = torch.Generator().manual_seed(0)
    x = torch.randn(120, 4, generator=g)
    torch.save({"x": x, "y": (x[:, 0] > 0).long()}, root / "t.pt")
    assert main(["data", "audit", "--set", "data.name=tensors", "--set", f"data.path={root / 't.pt'}", "--set",
                 "model.name=mlp", "--set", "model.width=8", "--set", "parallel.dp=1", "--set", "log.progress=false",
                 "--out", str(root / "audit"), "--folds", "2", "--epochs", "1"]) == 0
    tune = tune_page(root / "tune") if importlib.util.find_spec("optuna") else None
    found = {"tune study": tune, "training report": run / "report.html", "runs compare": root / "cmp" / "compare.html",
             "federated comparison": root / "fed" / "report.html", "federated run": root / "fed" / "fedavg" / "report.html",
             "data audit": root / "audit" / "report.html"}
    return found


def tune_page(out):
    """`plait tune`'s report.html for a study of 4 complete trials and a pruned one (Optuna's plots need no plait run)."""
    import optuna
    from optuna.distributions import FloatDistribution, IntDistribution
    from optuna.trial import TrialState, create_trial

    from plait.tune.report import write_report

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="minimize")
    space = {"optim.lr": FloatDistribution(1e-4, 1e-1, log=True), "model.width": IntDistribution(16, 64)}
    for lr, width, value in [(1e-3, 32, 0.9), (1e-2, 16, 0.7), (3e-2, 64, 0.5), (5e-2, 48, 0.6)]:
        study.add_trial(create_trial(params={"optim.lr": lr, "model.width": width}, distributions=space, value=value,
                                     intermediate_values={10: value + 0.2, 20: value}, user_attrs={"steps": 20}))
    study.add_trial(create_trial(params={"optim.lr": 1e-4, "model.width": 20}, distributions=space, state=TrialState.PRUNED,
                                 intermediate_values={10: 1.5}, user_attrs={"steps": 10}))
    summary = {"metric": "val_loss", "direction": "minimize", "pruner": "median", "trials": 5, "complete": 4, "pruned": 1,
               "failed": 0, "steps_run": 90, "steps_without_pruning": 100, "best_trial": 2, "best_value": 0.5,
               "best_params": {"optim.lr": 3e-2, "model.width": 64}, "best_run": "trials/0002"}
    out.mkdir()
    return write_report(study, summary, out)


NAMES = ["training report", "runs compare", "federated comparison", "federated run", "data audit", "tune study"]


@pytest.mark.parametrize("name", NAMES)
def test_the_page_renders_its_images_and_no_raw_dicts(pages, name):
    page = pages[name]
    if page is None:
        pytest.skip(f"{name}: needs optuna (pip install 'plait[tune]')")
    r = render(page)
    srcs = re.findall(r'<img[^>]*src="([^"]+)"', page.read_text())
    assert [src for src, _ in r["imgs"]] == srcs and (srcs or name == "data audit"), (name, r["imgs"])
    assert [src for src, width in r["imgs"] if width == 0] == [], f"{name}: images that did not load"
    text = r["text"]
    assert len(text) > 100, text
    raw = [text[max(0, m.start() - 60):m.end() + 60] for m in RAW.finditer(text)]
    assert raw == [], f"{name}: raw Python data in the page"
