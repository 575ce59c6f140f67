"""The Python API (plait.api, docs/api.md): every example of docs/api.md runs, in order, in one folder; the refusals."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import plait
from helpers import ENV
from plait.api import reference
from plait.errors import ConfigError

DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"
BLOCK = re.compile(r"(?:<!-- docs-test: (\w+) ?([^>]*?) -->\n)?```(\w+)\n(.*?)```", re.S)


def blocks() -> list[tuple[str, str, str, str]]:
    """(directive, argument, language, code) of each fenced block of docs/api.md."""
    return [m.groups() for m in BLOCK.finditer(DOC.read_text())]


def test_import_plait_is_cheap_and_the_verbs_are_callable():
    code = ("import sys, plait; assert 'torch' not in sys.modules; c = plait.Config.load(); "
            "assert callable(plait.train) and callable(plait.serve) and 'torch' not in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr


def test_docs_api_examples_run_in_order(tmp_path):
    """Each python block as a script in one folder (file blocks written first): train, export, load, serve, tables.

    The scripts run one after another in one interpreter (runpy, a fresh namespace each): torch is imported once.
    """
    scripts = []
    for directive, arg, lang, code in blocks():
        if directive == "skip" or lang != "python":
            continue
        if directive == "file":
            (tmp_path / arg.strip()).write_text(code)
            continue
        scripts.append(tmp_path / f"block{len(scripts)}.py")
        scripts[-1].write_text(code)
    assert len(scripts) == 5  # Config, train, export and load, serve, tables
    runner = ("import runpy, sys; sys.path.insert(0, '.')\n"
              "for s in sys.argv[1:]:\n    print('== ' + s, flush=True); runpy.run_path(s, run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-c", runner, *map(str, scripts)], cwd=tmp_path, capture_output=True, text=True,
                       env=ENV, timeout=300)
    assert r.returncode == 0, f"docs/api.md:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert "houses.csv has no column 'cost' (data.target); its columns: size, rooms, price" in r.stdout
    summary = plait.api.Result.from_run_dir(tmp_path / "runs" / "api").summary
    assert summary["steps"] == 30 and summary["world_size"] == 1


def _local():
    def inner(**_):
        return None

    return inner


@pytest.mark.parametrize("obj, message", [
    (lambda: None, "model: <lambda> is a lambda or a function defined inside another function; the workers are separate "
                   "processes that import it by name: define it at module level in a module"),
    (_local(), "model: _local.<locals>.inner is a lambda or a function defined inside another function"),
    (object(), "model: got object object; pass the function (or class) that makes it"),
])
def test_objects_the_workers_cannot_import_are_refused_saying_why(obj, message):
    with pytest.raises(ConfigError) as e:
        reference("model", obj)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_main_functions_are_refused_and_module_functions_named():
    import user_code

    assert reference("dataset", user_code.digits) == "user_code:digits"
    assert reference("dataset", user_code.Digits) == "user_code:Digits"
    fn = user_code.digits
    main = type(fn)(fn.__code__, fn.__globals__, "make")
    main.__module__, main.__qualname__ = "__main__", "make"
    with pytest.raises(ConfigError, match=r"^dataset: make is defined in the script being run \(__main__\)"):
        reference("dataset", main)


def test_config_values_override_and_validate():
    base = plait.Config.load()
    cfg = base.override("model.name=mlp", "data.name=digits", "parallel.dp=1")
    assert (base.model.name, cfg.model.name) == ("gpt", "mlp")  # override returns a new config
    assert cfg.validate() is cfg
    with pytest.raises(ConfigError, match="cannot train on data.name = 'stdlib-text'"):
        base.override("model.name=mlp").validate()
    with pytest.raises(ConfigError, match="expected 'section.key=value'"):
        base.override("train.steps")
    with pytest.raises(ConfigError, match="unknown key 'train.stepz'"):
        base.override("train.stepz=3")
    assert plait.Config.load(None, ["train.steps=7"]).train.steps == 7
