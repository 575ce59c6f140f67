"""data.name = "preference": prompt/chosen/rejected JSONL as TRL reads it (plait.data.preference).

Checked here: bad lines are named, an implicit prompt is the conversations' shared opening, long pairs are cut at
model.context + 1 tokens or left out and counted, and a pair's row holds its two sequences with positions restarting
and only the completions' targets. tests/train/test_preference_trl.py checks the token ids against TRL's DPOTrainer
token for token; tests/train/test_preference.py the losses on these rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from plait.config import load_config
from plait.data.preference import implicit_prompt
from plait.data.sources import build_data
from plait.errors import DataError

CHAR_LLAMA = ["model.name='llama'", "model.vocab_size=0", "model.layers=2", "model.width=32", "model.heads=4",
              "model.kv_heads=2", "model.hidden=48", "model.context=64", "data.name='preference'"]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_an_implicit_prompt_is_the_shared_opening():
    user, a, b = ({"role": r, "content": c} for r, c in (("user", "hi"), ("assistant", "yo"), ("assistant", "no")))
    assert implicit_prompt([user, a], [user, b]) == ([user], [a], [b])
    assert implicit_prompt([user, a, user, a], [user, a, user, b]) == ([user, a, user], [a], [b])
    assert implicit_prompt([a], [b]) == ([], [a], [b])


def test_a_pair_is_one_packed_row_with_only_the_completions_trained(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ab", "chosen": "c", "rejected": "dd"}] * 4)
    cfg = load_config(None, [*CHAR_LLAMA, f"data.path='{path}'", "train.objective='dpo'"])
    bundle = build_data(cfg.data, cfg.model)
    x, y = bundle.train.fetch(torch.tensor([0]))
    a, b, c, d = (int(bundle.tokenizer.encode(ch)[0]) for ch in "abcd")
    assert x[0].tolist() == [[a, b, a, b, d], [0, 1, 0, 1, 2]]  # 'abc' less its last, then 'abdd' less its last
    assert y[0, 0, :2].tolist() == [-100, c] and (y[0, 0, 2:] == -100).all()  # 'c' follows 'ab'
    assert y[0, 1, 2:].tolist() == [-100, d, d] and (y[0, 1, :2] == -100).all()
    assert torch.isnan(y[0, 2]).all()  # the reference log-probs: filled by plait.train.preference
    assert bundle.spec.preference and bundle.spec.packed and bundle.spec.tokens_per_sample == 5


def test_bad_files_are_named_by_line(tmp_path):
    def refusal(rows: list) -> str:
        path = write_jsonl(tmp_path / "pairs.jsonl", rows)
        cfg = load_config(None, [*CHAR_LLAMA, f"data.path='{path}'", "train.objective='dpo'"])
        with pytest.raises(DataError) as e:
            build_data(cfg.data, cfg.model)
        return str(e.value)

    assert "pairs.jsonl:2: a preference pair is" in refusal([{"prompt": "a", "chosen": "b", "rejected": "c"},
                                                             {"prompt": "a", "chosen": "b"}])
    talk = {"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
            "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "no"}]}
    assert "needs a chat template" in refusal([talk] * 3)  # the implicit prompt: the user's turn they share
    assert "holds 1 pair(s): too few" in refusal([{"prompt": "a", "chosen": "b", "rejected": "c"}])
    long = {"prompt": "x" * 80, "chosen": "b", "rejected": "c"}
    assert "0 usable pairs (of 3; 3 with a prompt of model.context = 64 tokens or more)" in refusal([long] * 3)


def test_long_pairs_are_cut_or_left_out_and_counted(tmp_path):
    """A sequence longer than model.context + 1 tokens loses its end (TRL's keep_start); a pair whose prompt alone
    fills that is left out (TRL drops it): summary.json's data counts both."""
    rows = [{"prompt": "a b", "chosen": " c", "rejected": " d"}] * 8
    rows += [{"prompt": "a b", "chosen": " " + "c" * 100, "rejected": " d"}, {"prompt": "x" * 70, "chosen": "c",
                                                                              "rejected": "d"}]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    cfg = load_config(None, [*CHAR_LLAMA, f"data.path='{path}'", "train.objective='dpo'", "data.val_fraction=0.2"])
    bundle = build_data(cfg.data, cfg.model)
    assert {k: bundle.stats[k] for k in ("examples", "truncated", "dropped", "limit_tokens")} == {
        "examples": 10, "truncated": 1, "dropped": 1, "limit_tokens": 65}
    assert len(bundle.train) + len(bundle.val) == 9
    x, y = (torch.cat(t) for t in zip(bundle.train.fetch(torch.arange(len(bundle.train))),
                                       bundle.val.fetch(torch.arange(len(bundle.val))), strict=True))
    longest = int((x[:, 1] == 0).logical_not().sum(1).argmax())  # the row with the cut chosen sequence
    assert int(x[longest, 1, :64].max()) == 63 and int((y[longest, 0] != -100).sum()) == 65 - 3  # less 'a b'
    assert x.shape[-1] == 64 + 4  # the widest row: 64 chosen inputs, then 'a b d' less its last character
