"""plait.exiting.exit_now: an entry point's process ends with its code, after its threads, atexit handlers and
unflushed files, without the modules' teardown."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_exit_now_keeps_what_an_orderly_exit_keeps(tmp_path):
    script = textwrap.dedent(f"""
        import atexit, threading, time
        from plait.exiting import exit_now

        left_open = open({str(tmp_path / "open.txt")!r}, "w")
        left_open.write("buffered, never flushed")  # no close: the interpreter's teardown would flush it
        atexit.register(lambda: open({str(tmp_path / "atexit.txt")!r}, "w").write("ran"))

        def late():
            time.sleep(0.3)
            open({str(tmp_path / "thread.txt")!r}, "w").write("joined")

        threading.Thread(target=late).start()
        print("printed", end="")  # no newline: sits in stdout's buffer (a pipe)
        exit_now(7)
        print("not reached")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (7, "printed", "")
    assert (tmp_path / "open.txt").read_text() == "buffered, never flushed"
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    assert (tmp_path / "thread.txt").read_text() == "joined"


def test_exit_now_of_none_is_status_0():
    r = subprocess.run([sys.executable, "-c", "from plait.exiting import exit_now; exit_now(None)"], timeout=60)
    assert r.returncode == 0
