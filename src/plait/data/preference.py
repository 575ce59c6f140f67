"""Preference data: `data.name = "preference"`, `data.path` = a JSONL file of pairs, one a line, as TRL reads them.

    {"prompt": "Q: 2 + 2?\\nA:", "chosen": " 4", "rejected": " 5"}                       # texts
    {"prompt": [{"role": "user", "content": "2 + 2?"}],                                # conversations, rendered
     "chosen": [{"role": "assistant", "content": "4"}], "rejected": [...]}             # with the chat template
    {"chosen": [...a whole conversation...], "rejected": [...]}                          # the prompt: what they share

Tokenized as TRL's DPOTrainer tokenizes (trl 1.16, `_prepare_dataset`): a text pair is the prompt alone and the prompt
followed by each completion and the end-of-sequence token, each encoded whole with the tokenizer's own special tokens
(a Llama 3 tokenizer's <|begin_of_text|>); a conversation is the prompt rendered with the assistant's turn opened
(add_generation_prompt) and the prompt plus each reply rendered whole, encoded as the template wrote them. A completion
starts where the prompt's tokens and the whole sequence's part (TRL's common prefix), so only its tokens count in the
log-probabilities. Each sequence is cut to model.context + 1 tokens at its end (TRL's max_length and "keep_start"),
and a pair whose prompt alone fills that is left out (TRL drops it too); both are counted in summary.json's `data`.

A pair is one row, the model's packed layout (plait.data.chat): inputs (n, 2, T), ids then positions, the chosen
sequence then the rejected one, positions restarting at 0 for each so that attention stays within each (plait's
llama), then padding; targets (n, 3, T) float64: the chosen completion's next tokens at the chosen sequence's places
(-100 elsewhere), the rejected one's at its places, and in the third row the reference model's log-probabilities of
the two completions (NaN until plait.train.preference fills them). T is the longest pair's, the same for every row.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from plait.data.chat import IGNORE, ChatTemplate, _token_text, split, template_of, tokenizer_config
from plait.data.datasets import Tensors
from plait.data.hf_tokenizer import HFTokenizer
from plait.data.spec import DataBundle, DataSpec
from plait.data.tokenizer import CharTokenizer
from plait.errors import DataError

PAIR = ("prompt", "chosen", "rejected")


def _messages(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                           and isinstance(m.get("content"), str) for m in value)


def implicit_prompt(chosen: list, rejected: list) -> tuple[list, list, list]:
    """A pair of whole conversations: the messages they share first are the prompt (TRL's extract_prompt)."""
    n = 0
    while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
        n += 1
    return chosen[:n], chosen[n:], rejected[n:]


def read_pairs(path: Path) -> list[tuple[str, dict]]:
    """(file:line, {"prompt", "chosen", "rejected"}) for each line: all three texts, or all three conversations."""
    if not path.is_file():
        raise DataError(f"data.path = {str(path)!r} does not exist; give a JSONL file of preference pairs")
    pairs = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            ex = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not a JSON object ({e.msg}); each line is one preference pair") from None
        if isinstance(ex, dict) and "prompt" not in ex and _messages(ex.get("chosen")) and _messages(ex.get("rejected")):
            ex = dict(zip(PAIR, implicit_prompt(ex["chosen"], ex["rejected"]), strict=True))
        texts = isinstance(ex, dict) and all(isinstance(ex.get(k), str) for k in PAIR)
        talks = isinstance(ex, dict) and all(_messages(ex.get(k)) for k in PAIR) and ex["chosen"] and ex["rejected"]
        if not (texts or talks):
            raise DataError(f"{where}: a preference pair is {{\"prompt\", \"chosen\", \"rejected\"}}, three strings or "
                            f"three lists of {{\"role\", \"content\"}} messages; found {line[:80]}")
        pairs.append((where, {k: ex[k] for k in PAIR}))
    if len(pairs) < 2:
        raise DataError(f"data.path = {str(path)!r} holds {len(pairs)} pair(s): too few to hold out a validation set")
    return pairs


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.nonzero(a[:n] != b[:n])[0]
    return int(differ[0]) if len(differ) else n


class PairEncoder:
    """A pair's token ids as TRL's DPOTrainer makes them: (chosen ids, rejected ids, where the completions start)."""

    def __init__(self, tok, template: ChatTemplate | None, eos: str):
        self.tok, self.template, self.eos = tok, template, eos

    def text(self, text: str) -> np.ndarray:
        # TRL calls the tokenizer on the whole text, which adds its special tokens (not the chat template's path)
        ids = self.tok.encode(text, special=True) if isinstance(self.tok, HFTokenizer) else self.tok.encode(text)
        return ids.astype(np.int64)

    def render(self, where: str, messages: list, opened: bool = False) -> np.ndarray:
        if self.template is None:
            raise DataError(f"{where}: a conversation needs a chat template, and data.tokenizer has no "
                            "tokenizer_config.json with a chat_template beside it; use a Hugging Face model directory's "
                            "tokenizer, or write the pairs as texts")
        return self.tok.encode(self.template.render(messages, add_generation_prompt=opened)).astype(np.int64)

    def __call__(self, where: str, ex: dict) -> tuple[np.ndarray, np.ndarray, int]:
        if isinstance(ex["prompt"], str):
            ends = ("" if c.endswith(self.eos) else self.eos for c in (ex["chosen"], ex["rejected"]))
            prompt = self.text(ex["prompt"])
            chosen, rejected = (self.text(ex["prompt"] + c + e) for c, e in zip((ex["chosen"], ex["rejected"]), ends))
        else:
            prompt = self.render(where, ex["prompt"], opened=True)
            chosen, rejected = (self.render(where, ex["prompt"] + ex[k]) for k in ("chosen", "rejected"))
        return chosen, rejected, min(common_prefix(prompt, chosen), common_prefix(prompt, rejected))


def pair_rows(pairs: list[tuple[np.ndarray, np.ndarray, int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (n, 2, width) and targets (n, 3, width) float64 of (chosen ids, rejected ids, completion start) pairs."""
    x = torch.zeros(len(pairs), 2, width, dtype=torch.long)
    y = torch.full((len(pairs), 3, width), float(IGNORE), dtype=torch.float64)
    y[:, 2] = float("nan")
    for r, (chosen, rejected, start) in enumerate(pairs):
        at = 0
        for k, ids in enumerate((chosen, rejected)):
            n = len(ids) - 1
            x[r, 0, at:at + n] = torch.from_numpy(ids[:-1])
            x[r, 1, at:at + n] = torch.arange(n)
            trained = np.arange(1, len(ids)) >= start  # targets that are completion tokens
            y[r, k, at:at + n] = torch.from_numpy(np.where(trained, ids[1:], IGNORE).astype(np.float64))
            at += n
    return x, y


def tokenizer_for(data_cfg, pairs: list[tuple[str, dict]]):
    if data_cfg.tokenizer:
        return HFTokenizer.from_file(data_cfg.tokenizer)
    texts = [m["content"] if isinstance(m, dict) else m for _, ex in pairs for k in PAIR
             for m in (ex[k] if isinstance(ex[k], list) else [ex[k]])]
    return CharTokenizer.fit("".join(texts), 1)  # characters seen in the pairs


def preference_source(data_cfg, model_cfg) -> DataBundle:
    path, limit = Path(data_cfg.path), model_cfg.context + 1
    pairs = read_pairs(path)
    config = tokenizer_config(data_cfg.tokenizer)
    tok = tokenizer_for(data_cfg, pairs)
    encode = PairEncoder(tok, template_of(config, data_cfg.tokenizer), _token_text(config.get("eos_token")))
    encoded: list = []
    truncated = dropped = 0
    for where, ex in pairs:
        chosen, rejected, start = encode(where, ex)
        if start >= limit:  # the prompt alone fills the context: no completion token would be left
            encoded.append(None)
            dropped += 1
            continue
        truncated += int(len(chosen) > limit or len(rejected) > limit)
        encoded.append((chosen[:limit], rejected[:limit], start))
    held_out = split(len(pairs), data_cfg.val_fraction)
    train_pairs = [e for i, e in enumerate(encoded) if e is not None and i not in held_out]
    val_pairs = [encoded[i] for i in sorted(held_out) if encoded[i] is not None]
    if not (train_pairs and val_pairs):
        raise DataError(f"data.path = {str(path)!r}: {len(train_pairs) + len(val_pairs)} usable pairs (of {len(pairs)}; "
                        f"{dropped} with a prompt of model.context = {model_cfg.context} tokens or more) are too few to "
                        "hold out a validation set")
    width = max(len(c) + len(r) - 2 for c, r, _ in train_pairs + val_pairs)
    train, val = Tensors(*pair_rows(train_pairs, width)), Tensors(*pair_rows(val_pairs, width))
    # each row's pair in the file (its line among the pairs), as split_tensors records it
    train.source_index = torch.tensor([i for i, e in enumerate(encoded) if e is not None and i not in held_out])
    val.source_index = torch.tensor([i for i in sorted(held_out) if encoded[i] is not None])
    spec = DataSpec(name="preference", task="lm", input_shape=[width], vocab_size=tok.vocab_size,
                    tokens_per_sample=width, packed=True, preference=True)
    stats = {"examples": len(pairs), "truncated": truncated, "dropped": dropped, "limit_tokens": limit,
             "rows": {"train": len(train), "val": len(val)}}
    return DataBundle(train, val, spec, tok, stats=stats)


def preference_turn(data_cfg, prompt: str | None) -> tuple[str, str] | None:
    """A preference run's end-of-run sample, as plait.data.chat.sample_turn makes a chat run's: (the text to continue,
    the end-of-sequence text), or None for other data. The text is `prompt` as a user's turn, or without one the first
    held-out pair's prompt as the model saw it (a conversation rendered with the assistant's turn opened)."""
    if data_cfg.name != "preference":
        return None
    config = tokenizer_config(data_cfg.tokenizer)
    template, eos = template_of(config, data_cfg.tokenizer), _token_text(config.get("eos_token"))
    if prompt is not None:
        messages = [{"role": "user", "content": prompt}]
    else:
        pairs = read_pairs(Path(data_cfg.path))
        messages = pairs[min(split(len(pairs), data_cfg.val_fraction))][1]["prompt"]
        if isinstance(messages, str):
            return messages, eos
    if template is None:
        return " ".join(m["content"] for m in messages), eos
    return template.render(messages, add_generation_prompt=True), eos
