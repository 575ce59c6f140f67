"""`pip install ARGS` into this interpreter's environment, done by uv where it can be had (the Makefile's installs).

uv (PyPI's `uv`) resolves and installs the same packages as pip several times faster: on 2 cores, torch, plait and the
dev extra from a warm cache take ~10 s against pip's ~110 s, most of a fresh clone's `make test` start. It is pip's
drop-in for this one command, not a new requirement: this script installs it into the environment with pip first, and
where that or uv itself fails, pip does the install as before.

uv reads no pip configuration, so pip's own (`pip config list`: pip.conf, PIP_* variables) is handed to it as its
UV_* variables: find-links, index-url, extra-index-url, constraint, cert, timeout; with extra indexes, the best version
over all indexes is taken, as pip takes it (uv's default takes the first index that has the package at all). Without
--no-compile, the installed packages are byte-compiled, as pip does by default.

    python tools/install.py [--no-compile] [pip install arguments...]
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

# pip's configuration key -> (uv's variable, separator of several values)
CARRIED = {"find-links": ("UV_FIND_LINKS", ","), "index-url": ("UV_INDEX_URL", " "),
           "extra-index-url": ("UV_EXTRA_INDEX_URL", " "), "constraint": ("UV_CONSTRAINT", " "),
           "cert": ("SSL_CERT_FILE", None), "timeout": ("UV_HTTP_TIMEOUT", None),
           "default-timeout": ("UV_HTTP_TIMEOUT", None)}
LINE = re.compile(r"^(?P<scope>[^.]*)\.(?P<key>[\w-]+)='(?P<value>.*)'$")


def pip(*args: str) -> list[str]:
    return [sys.executable, "-m", "pip", *args]


def uv_env(pip_config: str) -> dict[str, str]:
    """uv's variables for what `pip config list` printed: a PIP_* variable (shown as ':env:.KEY') over a file's value,
    a later file (pip lists global, user, site) over an earlier one."""
    files: dict[str, str] = {}
    environ: dict[str, str] = {}
    for line in pip_config.splitlines():
        m = LINE.match(line.strip())
        if m and m["key"] in CARRIED:
            (environ if m["scope"] == ":env:" else files)[m["key"]] = m["value"]
    env: dict[str, str] = {}
    for key, value in (files | environ).items():
        var, sep = CARRIED[key]
        env[var] = sep.join(value.split()) if sep else value
    if "UV_EXTRA_INDEX_URL" in env:
        env["UV_INDEX_STRATEGY"] = "unsafe-best-match"
    return env


def uv() -> str | None:
    """The environment's uv, installed with pip if missing; None where it cannot be had."""
    exe = Path(sys.executable).parent / "uv"
    if not exe.exists():
        r = subprocess.run(pip("install", "-q", "--disable-pip-version-check", "uv"), capture_output=True, text=True)
        if r.returncode or not exe.exists():
            return None
    return str(exe)


def main(argv: list[str]) -> int:
    compile_ = "--no-compile" not in argv
    args = [a for a in argv if a != "--no-compile"]
    exe = uv() if not os.environ.get("PLAIT_INSTALL_WITH_PIP") else None
    if exe:
        config = subprocess.run(pip("config", "list"), capture_output=True, text=True).stdout
        env = {**os.environ, **uv_env(config)}
        cmd = [exe, "pip", "install", "-q", "--python", sys.executable, *(["--compile-bytecode"] if compile_ else []),
               *args]
        if subprocess.run(cmd, env=env).returncode == 0:
            return 0
        print(f"note: uv could not install {' '.join(args)}; pip installs it", file=sys.stderr)
    flags = [] if compile_ else ["--no-compile"]
    return subprocess.run(pip("install", "-q", "--disable-pip-version-check", *flags, *args)).returncode


if __name__ == "__main__":  # the standard library only: this runs before anything is installed
    sys.exit(main(sys.argv[1:]))
