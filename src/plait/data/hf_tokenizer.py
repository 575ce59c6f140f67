"""A Hugging Face `tokenizer.json` (the `tokenizers` library) behind the CharTokenizer's interface.

    tok = HFTokenizer.from_file("gpt2/tokenizer.json")   # data.tokenizer, or a Hugging Face model directory
    tok.encode("def f") -> np.ndarray; tok.decode([...]) -> str; tok.to_json() -> the tokenizer.json text

A run trained with one writes that JSON as its tokenizer.json, so the run directory, its exports and
`plait serve` use the same tokenizer; `tokenizer_from_json` reads either kind back (packed data).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from plait.data.tokenizer import CharTokenizer
from plait.errors import DataError
from plait.extras import install_command

INSTALL = f"{install_command('hf')} (the tokenizers library)"


class HFTokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @classmethod
    def from_file(cls, path: str | Path, key: str = "data.tokenizer") -> HFTokenizer:
        path = Path(path)
        if not path.is_file():
            raise DataError(f"{key} = {str(path)!r} does not exist; give a Hugging Face tokenizer.json")
        return cls.from_json(path.read_text(encoding="utf-8"), f"{key} = {str(path)!r}")

    @classmethod
    def from_json(cls, text: str, where: str = "the tokenizer") -> HFTokenizer:
        """`where` names the file in errors."""
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(f"{where} is a Hugging Face tokenizer: {INSTALL}") from None
        try:
            return cls(Tokenizer.from_str(text))
        except Exception as e:  # the Rust parser's errors are plain Exceptions
            raise DataError(f"{where} is not a readable Hugging Face tokenizer.json ({str(e)[:200]})") from None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, special: bool = False) -> np.ndarray:
        """A stream of text, not a sentence: no special tokens added around it (special: the tokenizer's own, as
        transformers' tokenizer(text) adds them, a Llama 3's <|begin_of_text|>)."""
        ids = self.tokenizer.encode(text, add_special_tokens=special).ids
        return np.asarray(ids, dtype=np.int32)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """The text of `ids`; skip_special_tokens leaves out the tokenizer's special tokens (</s>, <|eot_id|>)."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        return self.tokenizer.to_str()



def tokenizer_from_json(text: str) -> CharTokenizer | HFTokenizer:
    """A stored tokenizer: plait's character tokenizer ({"type": "char", ...}) or a Hugging Face tokenizer.json."""
    data = json.loads(text)
    if isinstance(data, dict) and "chars" not in data and "model" in data:
        return HFTokenizer.from_json(text)
    return CharTokenizer.from_json(text)
