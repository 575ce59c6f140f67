"""Character-level tokenizer: one id per character seen often enough in training, id 0 for <unk>."""

from __future__ import annotations

import json

import numpy as np

UNK = "\ufffd"


def _codepoints(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)


class CharTokenizer:
    def __init__(self, chars: list[str]):
        self.chars = [UNK] + [c for c in chars if c != UNK]
        self._lut: np.ndarray | None = None

    @classmethod
    def fit(cls, text: str, min_count: int = 1) -> CharTokenizer:
        """Vocabulary = characters occurring at least min_count times, in code-point order."""
        counts = np.bincount(_codepoints(text))
        keep = np.nonzero(counts >= max(1, min_count))[0]
        return cls([chr(int(c)) for c in keep])

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        cps = _codepoints(text)
        if self._lut is None:
            top = max(ord(c) for c in self.chars) + 1
            self._lut = np.zeros(top, dtype=np.int32)
            for i, c in enumerate(self.chars):
                self._lut[ord(c)] = i
        ids = np.zeros(len(cps), dtype=np.int32)
        inside = cps < len(self._lut)
        ids[inside] = self._lut[cps[inside]]
        return ids.astype(np.int16 if self.vocab_size < 2**15 else np.int32)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] if 0 <= int(i) < len(self.chars) else UNK for i in ids)

    def to_json(self) -> str:
        return json.dumps({"type": "char", "chars": self.chars[1:]}, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> CharTokenizer:
        return cls(json.loads(text)["chars"])
