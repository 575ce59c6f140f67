"""The README and docs/ cannot drift from the code: every `plait ...` command in their shell blocks parses with the
real parser and names only config keys that exist; every Python block compiles, and the runnable one runs."""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ENV
from plait.cli import build_parser
from plait.config import SECTIONS, toml_key

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(lang: str) -> list[tuple[str, int, str]]:
    """(file, line, body) of every ```lang block."""
    out = []
    for f in DOCS:
        text = f.read_text()
        for m in re.finditer(rf"^```{lang}\n(.*?)^```", text, re.S | re.M):
            out.append((f.relative_to(ROOT).as_posix(), text[:m.start()].count("\n") + 1, m.group(1)))
    return out


def usage_free(tokens: list[str]) -> list[str]:
    """Usage notation out: `[--set k=v ...]` -> `--set k=v`, `[job.toml]` -> `job.toml`, `...` and its --set dropped."""
    out = []
    for t in tokens:
        if "=" not in t and (t.startswith("[") or t.endswith("]")):
            t = t.strip("[]")
        if t == "...":
            if out and out[-1] == "--set":
                out.pop()
            continue
        if t:
            out.append(t)
    return out


def commands() -> list[tuple[str, list[str]]]:
    found = []
    for where, line0, body in blocks("sh"):
        logical = []
        for i, line in enumerate(body.splitlines()):  # a trailing backslash continues the command
            if not logical or not logical[-1][1].endswith("\\"):
                logical.append((i, line))
            else:
                logical[-1] = (logical[-1][0], logical[-1][1][:-1] + " " + line)
        for i, line in logical:
            tokens = shlex.split(line, comments=True)
            for segment in " ".join(shlex.quote(t) for t in tokens).split(" '|' "):
                seg = shlex.split(segment)
                seg = seg[:seg.index(">")] if ">" in seg else seg  # a redirection is the shell's, not plait's
                if seg and seg[0] == "plait":
                    found.append((f"{where}:{line0 + i + 1}", usage_free(seg[1:])))
    return found


COMMANDS = commands()
KEYS = {f"{section}.{toml_key(k.name)}" for section, t in SECTIONS.items() for k in dataclasses.fields(t)}


def test_the_docs_have_commands_to_check():
    assert len(COMMANDS) > 50 and {c[1][0] for c in COMMANDS} >= {"train", "serve", "export", "slurm", "k8s", "fed"}


@pytest.mark.parametrize("where, args", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_every_documented_command_parses_and_names_real_keys(where, args):
    try:
        ns = build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"{where}: `plait {' '.join(args)}` does not parse")
    for item in getattr(ns, "set", None) or []:
        key = item.split("=", 1)[0]
        assert key in KEYS or key.split(".")[0] in {"model"} and key.startswith("model.options."), \
            f"{where}: --set {item}: no config key {key}"


def test_python_blocks_compile():
    for where, line, body in blocks("python"):
        compile(body, f"{where}:{line}", "exec")


def test_the_run_distributed_example_runs_as_a_script(tmp_path):
    (body,) = [b for _, _, b in blocks("python") if "run_distributed" in b]
    script = tmp_path / "example.py"
    script.write_text(body)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


PATH_KEYS = ("train.init_from", "distill.teacher", "data.path", "data.exclude")
TRAIN_ON_JOB = [(w, a) for w, a in COMMANDS if a[:2] == ["train", "job.toml"]]


@pytest.mark.parametrize("where, args", TRAIN_ON_JOB, ids=[w for w, _ in TRAIN_ON_JOB])
def test_documented_training_commands_are_valid_jobs(where, args):
    """job.toml is the default job (`plait config show > job.toml`): each command's overrides must make a job plait
    accepts (overrides naming files that only exist on the reader's machine are left out)."""
    from plait.errors import ConfigError
    from plait.train.job import load_job

    ns = build_parser().parse_args(args)
    sets = [s for s in ns.set if not s.startswith(PATH_KEYS)]
    try:
        load_job(None, sets)
    except ConfigError as e:
        pytest.fail(f"{where}: `plait {' '.join(args)}`: {e}")


def test_no_install_command_in_the_docs_moves_torch():
    """`pip install 'plait[X]'` alone resolves the extra's dependencies against the newest torch (a CUDA build): every
    documented install of an extra pins the installed torch (issue 38 item 1)."""
    loose = [f"{f.relative_to(ROOT)}:{n}" for f in DOCS for n, line in enumerate(f.read_text().splitlines(), 1)
             for m in re.finditer(r"pip install 'plait\[[a-z,]+\]'(.*)", line)
             if not m.group(1).startswith(''' "torch==$(python -c 'import torch; print(torch.__version__)')"''')]
    assert not loose, loose
    assert "extras:" in (ROOT / "Makefile").read_text()
