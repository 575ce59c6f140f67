"""Publishing a finished file: written under a temporary name, given the mode the user's umask asks for, renamed;
and the folder plait caches what it can rebuild in (`cache_dir()`: the tokenized corpus, the device profile).

Libraries that write through a private temporary file (safetensors does) leave it 0600; a model a user exports is
meant to be read by others on the machine as any file they create would be.
"""

from __future__ import annotations

import os
from pathlib import Path


def publish(tmp: Path, out: Path) -> Path:
    """Give `tmp` the default mode for new files (0666 minus the umask) and move it to `out` atomically."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp, 0o666 & ~mask)
    os.replace(tmp, out)
    return out


def cache_dir() -> Path:
    """Where plait keeps what it can rebuild or measure again: $PLAIT_CACHE, else ~/.cache/plait."""
    return Path(os.environ.get("PLAIT_CACHE") or Path.home() / ".cache" / "plait")


def json_objects(node):
    """Every object (dict) in a parsed JSON value, depth-first without recursion (a hostile file may nest deeply)."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            yield item
            stack.extend(item.values())
