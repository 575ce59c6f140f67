"""Trainer loop, optimizers and schedules, checkpoints, metrics."""

import sys  # noqa: E402

from plait import CallableModule  # noqa: E402

sys.modules[__name__].__class__ = CallableModule  # plait.train(...) calls the API's train (docs/api.md)
