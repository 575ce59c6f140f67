"""Instruction and chat data: `data.name = "chat"`, `data.path` = a JSONL file, one example per line.

    {"prompt": "Name a prime.", "completion": " Seven."}          # the loss is on the completion only
    {"messages": [{"role": "user", "content": "Hi"},            # rendered with the tokenizer's chat template;
                  {"role": "assistant", "content": "Hello!"}]}  # the loss is on the assistant turns only

A prompt/completion pair is the two texts back to back (the tokenizer's end-of-sequence token after the
completion, when tokenizer_config.json names one). Messages need a chat template: the `chat_template` of the
tokenizer_config.json next to data.tokenizer (a Hugging Face model directory has one), rendered with Jinja2
as transformers renders it. The assistant turns are found by rendering the conversation up to each one:
the text the template adds for turn i (after `add_generation_prompt` for it) is trained, the rest is not.

Each example becomes tokens and a target per token; a target that is not trained is -100, and the loss
(plait.train.loss.masked_lm_loss) is the mean over each row's trained tokens, then over rows: a row's
weight never depends on how the batch is split, so the mask is layout-independent. An example longer than
model.context + 1 tokens is cut to it (counted: the run's summary.json `data.truncated`).

`data.pack = true` fills rows of model.context tokens with consecutive examples (each whole, in order; the
rest of a row is padding that is never trained). Each row then carries its positions, restarting at 0 at
every example: inputs are (batch, 2, context), ids then positions, and plait's gpt and llama confine each
example's attention to itself, so a packed row gives the logits its examples give one by one. Without
packing a row is one example padded at the end (causal attention never looks at the padding).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from plait.data.datasets import Tensors
from plait.data.hf_tokenizer import HFTokenizer
from plait.data.spec import SPLIT_SEED, DataBundle, DataSpec
from plait.data.tokenizer import CharTokenizer
from plait.errors import DataError

IGNORE = -100  # a target the loss skips (PyTorch's ignore_index)


def read_examples(path: Path) -> list[tuple[str, dict]]:
    """(file:line, example) for each line: a dict with prompt and completion, or messages (checked here)."""
    if not path.is_file():
        raise DataError(f"data.path = {str(path)!r} does not exist; give a JSONL file of chat examples")
    examples = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            ex = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: not a JSON object ({e.msg}); each line is one example") from None
        where = f"{path}:{n}"
        if isinstance(ex, dict) and isinstance(ex.get("messages"), list):
            for m in ex["messages"]:
                if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                    raise DataError(f"{where}: each message needs a string 'role' and 'content'; found {str(m)[:80]}")
            if not any(m["role"] == "assistant" for m in ex["messages"]):
                raise DataError(f"{where}: the conversation has no 'assistant' message: nothing to train on")
        elif not (isinstance(ex, dict) and isinstance(ex.get("prompt"), str) and isinstance(ex.get("completion"), str)):
            raise DataError(f"{where}: an example is {{\"prompt\": str, \"completion\": str}} or {{\"messages\": "
                            f"[{{\"role\", \"content\"}}, ...]}}; found {line[:80]}")
        examples.append((where, ex))
    if len(examples) < 2:
        raise DataError(f"data.path = {str(path)!r} holds {len(examples)} example(s): too few to hold out a validation "
                        "set")
    return examples


def _token_text(value) -> str:
    """tokenizer_config.json's bos/eos entries: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


class ChatTemplate:
    """A tokenizer_config.json's chat template, rendered as transformers renders it (Jinja2, sandboxed)."""

    def __init__(self, source: str, bos: str = "", eos: str = ""):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self.template, self.bos, self.eos, self.source = env.from_string(source), bos, eos, source

    def render(self, messages: list[dict], add_generation_prompt: bool = False, **variables) -> str:
        """The conversation as text; `variables` are what transformers' apply_chat_template passes on (tools=...)."""
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.bos, eos_token=self.eos, **variables)


def tokenizer_config(tokenizer_path: str) -> dict:
    """The tokenizer_config.json next to data.tokenizer ({} when there is none)."""
    path = Path(tokenizer_path).with_name("tokenizer_config.json") if tokenizer_path else None
    if path is None or not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not JSON ({e.msg})") from None


def template_of(config: dict, tokenizer_path: str) -> ChatTemplate | None:
    source = config.get("chat_template")
    if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if not source:
        return None
    try:
        return ChatTemplate(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))
    except Exception as e:  # jinja2's TemplateSyntaxError and friends
        raise DataError(f"the chat template of {Path(tokenizer_path).with_name('tokenizer_config.json')} does not "
                        f"parse ({e})") from None


def pieces(where: str, ex: dict, template: ChatTemplate | None, eos: str) -> list[tuple[str, bool]]:
    """The example's text as (text, trained) pieces in order."""
    if "messages" not in ex:
        return [(ex["prompt"], False), (ex["completion"] + eos, True)]
    if template is None:
        raise DataError(f"{where}: a conversation needs a chat template, and data.tokenizer has no tokenizer_config.json "
                        "with a chat_template beside it; use a Hugging Face model directory's tokenizer, or write the "
                        "examples as {\"prompt\", \"completion\"}")
    msgs = ex["messages"]
    full = template.render(msgs)
    out, last = [], 0
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before = template.render(msgs[:i], add_generation_prompt=True)
        upto = template.render(msgs[:i + 1])
        if not (upto.startswith(before) and full.startswith(upto) and len(before) >= last):
            raise DataError(f"{where}: the chat template does not render a conversation as the one before it plus the "
                            f"new turn, so assistant turn {i} cannot be located; use {{\"prompt\", \"completion\"}}")
        out += [(full[last:len(before)], False), (full[len(before):len(upto)], True)]
        last = len(upto)
    out.append((full[last:], False))
    return [(t, trained) for t, trained in out if t]


def encode(tok, parts: list[tuple[str, bool]]) -> tuple[np.ndarray, np.ndarray]:
    """(ids, trained) of the pieces, each encoded on its own."""
    ids = [tok.encode(t).astype(np.int64) for t, _ in parts]
    flags = [np.full(len(i), trained) for i, (_, trained) in zip(ids, parts, strict=True)]
    return np.concatenate(ids), np.concatenate(flags)


def rows(examples: list[tuple[np.ndarray, np.ndarray]], context: int, pack: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (n, context) — packed: (n, 2, context), ids then positions — and targets (n, context)."""
    packed: list[list[tuple[np.ndarray, np.ndarray]]] = []
    for ids, trained in examples:
        if pack and packed and sum(len(i) - 1 for i, _ in packed[-1]) + len(ids) - 1 <= context:
            packed[-1].append((ids, trained))
        else:
            packed.append([(ids, trained)])
    x = torch.zeros(len(packed), 2, context, dtype=torch.long)
    y = torch.full((len(packed), context), IGNORE, dtype=torch.long)
    for r, row in enumerate(packed):
        at = 0
        for ids, trained in row:
            n = len(ids) - 1
            x[r, 0, at:at + n] = torch.from_numpy(ids[:-1])
            x[r, 1, at:at + n] = torch.arange(n)
            y[r, at:at + n] = torch.from_numpy(np.where(trained[1:], ids[1:], IGNORE))
            at += n
    return (x if pack else x[:, 0].contiguous()), y


def trim_padding(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch of (unpacked) chat rows cut after its last trained target: a causal model's logits at the kept
    positions never see the positions cut, and the cut ones hold no target, so the loss is the same, on fewer positions
    (the peers' collators pad each batch to its longest row; rows of model.context computed 8.7 % more positions on
    benchmarks/finetune_vs_peers.py's data). The training step's batch transform where shapes may vary (no tp, cp, pp or
    torch.compile: plait.train.build)."""
    x, y = batch
    trained = (y != IGNORE).any(0).nonzero()
    keep = int(trained[-1]) + 1 if len(trained) else 1
    return (x, y) if keep == y.shape[1] else (x[:, :keep], y[:, :keep])


def trims_padding(spec: DataSpec, layout, compiled: bool) -> bool:
    """Whether a job's training batches take trim_padding: chat rows, not packed, a layout whose shapes may vary."""
    return (spec.name == "chat" and spec.masked_targets and not spec.packed and not compiled
            and layout.tp == 1 and layout.cp == 1 and layout.pp == 1)


def chat_source(data_cfg, model_cfg) -> DataBundle:
    path, context = Path(data_cfg.path), model_cfg.context
    examples = read_examples(path)
    config = tokenizer_config(data_cfg.tokenizer)
    template = template_of(config, data_cfg.tokenizer)
    eos = _token_text(config.get("eos_token"))
    texts = [pieces(where, ex, template, eos) for where, ex in examples]
    if data_cfg.tokenizer:
        tok = HFTokenizer.from_file(data_cfg.tokenizer)
    else:  # characters seen in the examples (min_char_count applies to text corpora, not to a few examples)
        tok = CharTokenizer.fit("".join(t for parts in texts for t, _ in parts), 1)
    encoded, truncated = [], 0
    for parts in texts:
        ids, trained = encode(tok, parts)
        if len(ids) > context + 1:
            ids, trained, truncated = ids[:context + 1], trained[:context + 1], truncated + 1
        encoded.append((ids, trained) if len(ids) >= 2 else None)  # one token: nothing to predict
    held_out = split(len(examples), data_cfg.val_fraction)
    train_rows = [e for i, e in enumerate(encoded) if e is not None and i not in held_out]
    val_rows = [encoded[i] for i in sorted(held_out) if encoded[i] is not None]
    if not (train_rows and val_rows):
        raise DataError(f"data.path = {str(path)!r}: {len(train_rows) + len(val_rows)} examples are too few to hold out "
                        "a validation set")
    train, val = rows(train_rows, context, data_cfg.pack), rows(val_rows, context, data_cfg.pack)
    spec = DataSpec(name="chat", task="lm", input_shape=[context], vocab_size=tok.vocab_size, tokens_per_sample=context,
                    masked_targets=True, packed=bool(data_cfg.pack))
    stats = {"examples": len(examples), "truncated": truncated, "limit_tokens": context + 1,
             "rows": {"train": len(train[0]), "val": len(val[0])},
             "trained_tokens": int((train[1] != IGNORE).sum())}
    return DataBundle(Tensors(*train), Tensors(*val), spec, tok, stats=stats)


def split(n: int, val_fraction: float) -> set[int]:
    """The indices of the examples held out for validation (seeded by SPLIT_SEED, never by train.seed)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED)).tolist()
    return set(perm[:max(1, int(n * val_fraction))])


def sample_turn(data_cfg, prompt: str | None) -> tuple[str, str] | None:
    """A chat run's end-of-run sample: (the text to continue, the end-of-sequence text that ends the reply), or None
    for other data. The text is `prompt` as a user's turn, or without one the first held-out example's opening (its
    turns before the first assistant reply, or its prompt), rendered through the tokenizer's chat template with the
    assistant's turn opened, as the data was; a prompt/completion pair is its prompt as it stands."""
    if data_cfg.name != "chat":
        return None
    config = tokenizer_config(data_cfg.tokenizer)
    template, eos = template_of(config, data_cfg.tokenizer), _token_text(config.get("eos_token"))
    if prompt is not None:
        messages = [{"role": "user", "content": prompt}]
    else:
        examples = [ex for _, ex in read_examples(Path(data_cfg.path))]
        ex = examples[min(split(len(examples), data_cfg.val_fraction))]
        if "messages" not in ex:
            return ex["prompt"], eos
        messages = ex["messages"][:next(i for i, m in enumerate(ex["messages"]) if m["role"] == "assistant")]
    if template is None:  # prompt/completion pairs without a template: the prompt as it stands
        return " ".join(m["content"] for m in messages), eos
    return template.render(messages, add_generation_prompt=True), eos
