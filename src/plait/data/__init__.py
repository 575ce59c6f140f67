"""Data sources, the character tokenizer, the layout-independent sampler and the step loader.

The names below are imported on first use (PEP 562): plait.data.keys, the [data] section's keys, is read by
`plait config show`, which must not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_FROM = {"SOURCES": "sources", "build_data": "sources", "DataBundle": "spec", "DataSpec": "spec"}
__all__ = sorted(_FROM)


def __getattr__(name: str) -> Any:
    if name in _FROM:
        return getattr(importlib.import_module(f"plait.data.{_FROM[name]}"), name)
    raise AttributeError(f"module 'plait.data' has no attribute {name!r}")
