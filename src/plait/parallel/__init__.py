"""Parallel layouts: the layout, and each scheme as a declaration (plait.parallel.schemes.<name>, in the one ordered
list plait.parallel.schemes) and an implementation (plait.parallel.<name>: DTensor, FSDP2, pipelining, RPC).

    check_config(cfg)             # the layout's arithmetic and every scheme's own keys; ConfigError before launch
    strategy = build_strategy(b)  # b: a plait.parallel.scheme.Build; the Strategy that owns the step

The names below are imported on first use (PEP 562): plait.parallel.keys, the schemes' keys, is read by
`plait config show`, which must not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_FROM = {"SCHEMES": "schemes", "build_strategy": "assemble", "check_config": "schemes", "step_owner": "schemes",
         "Build": "scheme", "Scheme": "scheme", "Layout": "layout", "Precision": "base", "Strategy": "base"}
__all__ = sorted(_FROM)


def __getattr__(name: str) -> Any:
    if name in _FROM:
        return getattr(importlib.import_module(f"plait.parallel.{_FROM[name]}"), name)
    raise AttributeError(f"module 'plait.parallel' has no attribute {name!r}")
