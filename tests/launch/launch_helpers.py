"""Helpers of the launcher tests (tests/launch/conftest.py has the fixtures)."""

from __future__ import annotations

import socket
import subprocess
import sys

from helpers import ENV, free_port  # noqa: F401  (the launcher tests' ports: helpers.free_port)


def plait_env(*args, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run the plait CLI in a subprocess with `env` (default: the tests' ENV)."""
    return subprocess.run([sys.executable, "-m", "plait", *map(str, args)], capture_output=True, text=True,
                          env=env or ENV, timeout=timeout)


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def cli(*args) -> tuple[int, str, str]:
    """plait's CLI in this process (no interpreter and torch start-up): (exit code, stdout, stderr)."""
    import contextlib
    import io

    from plait.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # argparse's errors
            code = e.code if isinstance(e.code, int) else 2
    return code, out.getvalue(), err.getvalue()


def run_weights(run) -> dict:
    """A run's exported weights, exported in this process (as `plait export` does)."""
    from safetensors.torch import load_file

    from plait.export import export

    return load_file(str(export(run, run / "model.safetensors")))
