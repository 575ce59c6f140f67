"""A served model's signature: its inputs and outputs as Open Inference Protocol tensors, and what a request holds.

Torch-free and numpy-free: the service, the executors and the HTTP codec (plait.serve.entrypoints.protocol) share it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ITEMS_SLACK = 4096  # what a request holds besides its tensors' data: shapes, outputs, parameters, names


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a served model; -1 in `shape` means any size."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.name} ({self.datatype} {list(self.shape)})"

    def as_json(self) -> dict:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


def request_items(specs: list[TensorSpec], rows: int, fill: int | None = None) -> int | None:
    """The most items (as `check_items` counts them) a request of `rows` rows of these inputs can hold, its data flat
    or nested; None when an input has a free dimension past the batch one (-1, unless `fill` stands for it)."""
    total = ITEMS_SLACK
    for spec in specs:
        dims = [fill if d < 0 and fill else d for d in spec.shape[1:]]
        if any(d < 0 for d in dims):
            return None
        arrays = 1 + rows * sum(math.prod(dims[:j]) for j in range(len(dims)))  # every level of nesting but the last
        total += rows * math.prod(dims) + arrays
    return total
