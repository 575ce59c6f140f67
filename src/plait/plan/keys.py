"""The planner's keys: parallel.auto (choose the layout at launch) and launch.device_memory (what it plans for).

Torch-free, like every keys module: `plait config show` lists them without importing torch.
"""

from __future__ import annotations

import re

from plait.config import keys, opt
from plait.errors import ConfigError

UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def parse_size(text: str, what: str) -> float:
    """'80GB' -> 80e9 bytes, '16GiB' -> 16 * 2**30."""
    m = re.fullmatch(r"\s*([\d.]+(?:e\d+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if not m:
        raise ConfigError(f"{what} = {text!r} is not a size; write e.g. 80GB or 16GiB")
    return float(m.group(1)) * UNITS[m.group(2) or ""]


def parse_rate(text: str, what: str) -> float:
    """'400Gbps' -> bytes per second (bits / 8); '50GB/s' -> bytes per second."""
    m = re.fullmatch(r"\s*([\d.]+(?:e\d+)?)\s*([kmgt]?)(bps|b/s|bit/s)\s*", text, re.IGNORECASE)
    if not m:
        raise ConfigError(f"{what} = {text!r} is not a rate; write e.g. 400Gbps (bits) or 50GB/s (bytes)")
    value = float(m.group(1)) * UNITS[m.group(2).lower()]
    return value if m.group(3) in ("B/s",) else value / 8


@keys("parallel")
class AutoKeys:
    auto: bool = opt(False, "choose the layout at launch (dp, tp, pp, cp, ZeRO stage, micro-batch, activation "
                            "checkpointing): plait plan's fastest one predicted to fit launch.device_memory on the "
                            "processes launch.nproc_per_node x nnodes gives (GPTs); a resume on another process count "
                            "plans again")
    auto_reason: str = opt("", "written by parallel.auto: the layout it chose and why (config.toml, summary.json)")


@keys("launch")
class DeviceMemoryKeys:
    device_memory: str = opt("", "memory of one device (process) for parallel.auto to plan within, e.g. 80GB or "
                                 "512MB (empty: the calibration file's, else the datasheet's 80 GB)")

    def check(self, cfg) -> None:
        if self.device_memory:
            parse_size(self.device_memory, "launch.device_memory")
