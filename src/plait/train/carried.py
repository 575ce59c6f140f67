"""A Hugging Face checkpoint's own files, carried through a run into its export.

    carry(run_dir, cfg.train.init_from)   # at a run's start: the source's files copied into RUN/hf/ (once)
    carried_dir(run_dir)                  # RUN/hf/ when the run carries them (None otherwise)

config.json, generation_config.json and the tokenizer's files (tokenizer_config.json with its chat template,
special_tokens_map.json, ...) hold what transformers and servers read beside the weights and plait does not use:
eos_token_id, bos_token_id, the chat template, the generation defaults. A run keeps them as they were, so that
`plait export --format hf` writes them back, changed only where the training changed them, even once the source
directory is gone. A run started from another run directory carries that run's copies on; a resumed run keeps its
own. Only regular files are copied: a symlink in the source is left behind, wherever it points.
"""

from __future__ import annotations

import shutil
from pathlib import Path

FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
         "chat_template.jinja", "chat_template.json", "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt")
FOLDER = "hf"


def carried_dir(run_dir: Path) -> Path | None:
    d = Path(run_dir) / FOLDER
    return d if (d / "config.json").is_file() else None


def carry(run_dir: Path, source: str) -> None:
    """Copy train.init_from's Hugging Face files (or a source run's carried ones) into RUN/hf/, unless it has them."""
    if not source or carried_dir(run_dir) is not None:
        return
    src = Path(source)
    src = (carried_dir(src) or src) if src.is_dir() else None
    if src is None or not (src / "config.json").is_file():
        return
    out = Path(run_dir) / FOLDER
    out.mkdir(parents=True, exist_ok=True)
    for name in FILES[1:] + FILES[:1]:  # config.json last: its presence says the copy is whole
        f = src / name
        if f.is_file() and not f.is_symlink():
            tmp = out / (name + ".tmp")
            shutil.copyfile(f, tmp)
            tmp.replace(out / name)
