"""Known-harmless lines of third-party libraries, kept off plait's consoles (PLAIT_VERBOSE=1 shows them).

Each entry: the logger that emits it, the start of its message, and why it is harmless here. The filters are
attached to the loggers by name when plait is imported, before the library itself is, so every process (the CLI,
training workers, replicas) is quiet the same way.
"""

from __future__ import annotations

import logging
import os

KNOWN = [
    ("torchao", "Failed to load ", "torchao's optional CUDA/CUTLASS kernels (_C_*.so) do not load on a CPU build; "
                                   "plait uses its CPU paths"),
    ("torch.utils._pytree", "%s is an Enum subclass and is now natively supported",
     "torchao registers its enums (KernelPreference, ...) the old way; a deprecation notice for torchao"),
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward",
     "bitsandbytes looks for an optional Hub kernel (no network here); its own CPU nf4 path runs"),
    ("torch.onnx._internal.exporter._registration", "torchvision is not installed",
     "the ONNX exporter skips torchvision's operators, which plait's models never use"),
    ("torch.distributed.elastic.agent.server.api", "Received %s death signal, shutting down workers",
     "the launcher got Ctrl-C or SIGTERM: plait's own line says so, with the checkpoint and the resume command"),
    ("torch.distributed.elastic.multiprocessing.api", "Closing process %s via signal %s",
     "the agent passing that signal on to each worker, one line per worker, as part of the same stop"),
    ("ray.train.v2._internal.execution.controller.placement_group_cleaner", "Failed to query Ray Train Controller",
     "Ray Train's clean-up watcher asks the State API, which a local Ray cluster started without its dashboard "
     "(launch.launcher = 'ray') does not serve; ray.shutdown() frees the placement group itself"),
]


class _Known(logging.Filter):
    def __init__(self, starts: str):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def install() -> None:
    """Attach the filters (once); PLAIT_VERBOSE=1 leaves every line."""
    if os.environ.get("PLAIT_VERBOSE") == "1":
        return
    for name, starts, _why in KNOWN:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Known) and f.starts == starts for f in logger.filters):
            logger.addFilter(_Known(starts))


__all__ = ["KNOWN", "install"]
