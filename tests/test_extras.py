"""A missing extra is one line naming the extra and an install command that keeps torch, for every verb; a
torchvision built for another torch is said at start-up (issue 38 items 1-2)."""

import importlib.metadata as metadata
import sys
from pathlib import Path

import pytest

from plait import extras
from plait.cli import main
from serve_helpers import mlp_run  # noqa: F401

PIN = f"torch=={metadata.version('torch').split('+')[0]}"


def cli(*args) -> tuple[int, str]:
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main([str(a) for a in args])
    return code, err.getvalue()


@pytest.mark.parametrize("module, verb, extra, what", [
    ("onnx", lambda run, tmp: ["export", run, "-o", tmp / "m.onnx"], "edge", "ONNX export"),
    ("litdata", lambda run, tmp: ["data", "pack", "digits", "-o", tmp / "packed"], "data", "packed datasets (LitData)"),
])
def test_a_missing_extra_is_one_line_naming_it(mlp_run, tmp_path, monkeypatch, module, verb, extra, what):  # noqa: F811
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now fails as it does when it is not installed
    code, err = cli(*verb(mlp_run, tmp_path))
    assert code == 2, err
    assert err.strip() == (f"error: {what} needs the {module} package, which is not installed: pip install "
                           f"'plait[{extra}]' '{PIN}' (the torch pin keeps your torch; from a checkout, "
                           f"`make extras EXTRAS={extra}`)")


def test_a_module_of_no_extra_still_raises():
    err = ModuleNotFoundError("No module named 'nothing_here'", name="nothing_here")
    assert extras.missing_extra(err) is None


def test_a_torchvision_for_another_torch_is_said_in_one_line(monkeypatch):
    real_version, real_requires = metadata.version, metadata.requires
    versions = {"torch": "2.13.0+cpu", "torchvision": "0.29.1"}
    monkeypatch.setattr(metadata, "version", lambda name: versions.get(name) or real_version(name))
    monkeypatch.setattr(metadata, "requires", lambda name: ["numpy", "torch==2.14.1", "pillow!=8.3.*,>=5.3.0"]
                        if name == "torchvision" else real_requires(name))
    assert extras.torchvision_warning() == (
        "warning: torchvision 0.29.1 is built for torch 2.14.1, not the installed torch 2.13.0: it cannot load, and "
        "`import transformers` fails with it; plait does not use it: pip uninstall -y torchvision")
    monkeypatch.setattr(metadata, "requires", lambda name: ["torch==2.13.0"])
    assert extras.torchvision_warning() is None
    assert extras.install_command("data") == "pip install 'plait[data]' 'torch==2.13.0'"


def test_no_message_in_plait_gives_an_install_command_that_moves_torch():
    """Every install command plait prints comes from plait.extras.install_command (the installed torch pinned)."""
    src = Path(__file__).resolve().parents[1] / "src" / "plait"
    bare = [f"{p.relative_to(src)}:{i}" for p in sorted(src.rglob("*.py")) if p.name != "extras.py"
            for i, line in enumerate(p.read_text().splitlines(), 1) if "pip install 'plait[" in line]
    assert bare == []
