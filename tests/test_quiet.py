"""Known-harmless third-party lines stay off plait's consoles; PLAIT_VERBOSE=1 shows them (issue 38 item 9)."""

import logging
import subprocess
import sys

import pytest

from helpers import ENV
from plait import quiet


@pytest.mark.parametrize("name, starts, why", quiet.KNOWN)
def test_each_known_line_is_dropped_and_others_pass(name, starts, why):
    quiet.install()
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        logger.warning(starts + " and the rest of it")
        logger.warning("an unrelated warning")
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in seen] == ["an unrelated warning"] and why


def test_importing_torchao_through_plait_is_quiet_unless_verbose():
    pytest.importorskip("torchao")
    code = "import plait, torchao"
    quiet_run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    loud = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**ENV, "PLAIT_VERBOSE": "1"})
    assert quiet_run.returncode == loud.returncode == 0
    for _, starts, _ in quiet.KNOWN:
        assert starts.replace("%s ", "") not in quiet_run.stderr
    assert len(quiet_run.stderr.splitlines()) < len(loud.stderr.splitlines()) or not loud.stderr
