"""Data sources, the character tokenizer, the layout-independent sampler and the step loader."""

from plait.data.sources import SOURCES, DataBundle, build_data
from plait.data.spec import DataSpec

__all__ = ["SOURCES", "DataBundle", "DataSpec", "build_data"]
