"""Ending a plait process promptly once its work is done.

After `sys.exit`, a Python process that has imported torch spends most of a second (0.6 s for torch alone on a
2-core machine, about 1.2 s with DTensor, DCP and plait's own modules) tearing its modules down: work nobody waits
for, paid by every `plait` command, every launcher and every worker. `exit_now(code)` does what an orderly exit
must do, in the order the interpreter does it (wait for non-daemon threads, run the atexit handlers: trackers,
multiprocessing's children, weakref finalizers, temporary folders), flushes every file still open, and then ends
the process with `os._exit(code)`, skipping only that teardown.

Only the entry points call it (`python -m plait`, the `plait` script, `python -m plait.worker`), never a function a
caller's own process (a test, a notebook, plait.train) runs.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import os
import sys
import threading
from typing import NoReturn

_BUFFERED = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)  # what holds written bytes not yet in the file


def exit_now(code: int | None) -> NoReturn:
    """End this process with exit status `code` (None: 0), as `sys.exit(code)` would, minus the modules' teardown."""
    status = 0 if code is None else int(code)
    main = threading.main_thread()
    for thread in threading.enumerate():  # what the interpreter's shutdown waits for first
        if thread is not main and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # CPython's own: runs (and clears) every handler registered with atexit
    for obj in gc.get_objects():  # a file a library left open: the teardown would have flushed it
        if type(obj) in _BUFFERED:
            with contextlib.suppress(Exception):
                if not obj.closed and obj.writable():
                    obj.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)
