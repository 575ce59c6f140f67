"""What a packed dataset's plait.json says (`plait data pack` writes it): its format, and the source it was packed
from. Torch-free: the job check asks which source a packed dataset holds (plait.train.job) before anything is
imported to read it (plait.data.packed).
"""

from __future__ import annotations

import json
from pathlib import Path

from plait.errors import DataError

FORMAT = "plait-packed/1"


def is_remote(path: str) -> bool:
    """An object-store URL (s3://...), which the packed source does not read."""
    return "://" in path and not path.startswith("file://")


def read_meta(path: str) -> dict:
    """plait.json of the packed dataset at `path`; DataError when there is none or it is of another format."""
    meta_file = Path(path) / "plait.json"
    if not meta_file.is_file():
        raise DataError(f"data.path = {path!r} has no plait.json: it is not a packed dataset; write one with "
                        "`plait data pack SOURCE -o DIR`")
    try:
        meta = json.loads(meta_file.read_text())
    except ValueError as e:
        raise DataError(f"{meta_file} is not valid JSON ({e}); re-run `plait data pack`") from None
    if meta.get("format") != FORMAT:
        raise DataError(f"{meta_file}: format {meta.get('format')!r} is not {FORMAT!r}; re-pack with this plait")
    return meta


def source_name(data_cfg) -> str:
    """data.name, or for packed data the name of the source it was packed from (what model checks need)."""
    if getattr(data_cfg, "factory", ""):
        return "factory"
    if data_cfg.name != "packed" or not data_cfg.path or is_remote(data_cfg.path):
        return data_cfg.name
    try:
        return str(read_meta(data_cfg.path).get("source", {}).get("name") or "packed")
    except DataError:
        return "packed"  # reading the data says what is wrong with it

