"""The suite's warm `plait` (tests/helpers.py: plait(), start_cli, WarmCLI): a process forked from the pytest worker's
warm server prints and exits as the `plait` script does in a new interpreter."""

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ENV, WarmCLI, plait

DOCS_RUN = Path(__file__).with_name("test_docs_run.py")
CASES = [
    ("config", "show", "--set", "optim.lr=0.5"),  # prints the job, exit 0
    ("config", "show", "--set", "optim.lr=oops"),  # a bad value: one line on stderr, exit 2
    ("train", "--set", "nosuch.key=1"),  # an unknown key
]


def cold(*args, cwd=None, stdin=None) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "plait"), *args], capture_output=True, text=True, env=ENV,
                          cwd=cwd, input=stdin, timeout=120)


@pytest.mark.parametrize("args", CASES, ids=["show", "bad-value", "unknown-key"])
def test_the_warm_plait_prints_and_exits_as_the_plait_script(args, tmp_path):
    want, got = cold(*args, cwd=tmp_path), plait(*args, cwd=tmp_path)
    assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout, want.stderr)
    assert want.returncode == (0 if args[-1] == "optim.lr=0.5" else 2)


def test_a_docs_client_gets_the_exit_status_and_output_of_its_plait(tmp_path):
    """The docs' shell `plait` (test_docs_run.py's client, through a WarmCLI): its fds (a `> file` redirection, its
    stderr), its working dir and its exit status, as the cold script's."""
    server = WarmCLI(tmp_path)
    try:
        env = {**ENV, "PLAIT_DOCS_WARM_CLI": server.path}
        script = (f"{sys.executable} {DOCS_RUN} plait config show --set optim.lr=0.25 > job.toml; echo \"show $?\"; "
                  f"{sys.executable} {DOCS_RUN} plait config show job.toml; echo \"again $?\"; "
                  f"{sys.executable} {DOCS_RUN} plait config show --set optim.lr=oops; echo \"bad $?\"")
        r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    finally:
        server.close()
    job = cold("config", "show", "--set", "optim.lr=0.25").stdout
    assert (tmp_path / "job.toml").read_text() == job
    assert r.stdout == f"show 0\n{cold('config', 'show', 'job.toml', cwd=tmp_path).stdout}again 0\nbad 2\n"
    assert r.stderr == cold("config", "show", "--set", "optim.lr=oops").stderr
