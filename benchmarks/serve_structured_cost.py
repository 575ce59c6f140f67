"""What structured output costs a decode step: the engine's step with every sequence's token mask (llguidance, the
JSON schema of docs/serving.md) against the same step unmasked. Target (issue 55 item 4): at most 10 % more.

    python benchmarks/serve_structured_cost.py [--vocab 32000] [--batch 16] [--steps 60] [--repeats 3]

A byte-level BPE trained here on the repository's own text (a realistic vocabulary; no hub is reachable), a random
plait Llama of about 10 M parameters over it, and `--batch` sequences decoding together on the engine of `plait serve`
(plait.serve.engine.core.Engine, stepped by hand). Each repeat times `--steps` decode steps of the masked batch and of
the unmasked one (the baseline, measured in the same run), alternating; it prints the median step times, their ratio,
the A/A floor (the unmasked batch against itself) and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from plait.models.llama import Llama
from plait.serve.engine.core import Engine, EngineConfig, SamplingParams
from plait.serve.engine.grammar import Grammars

# Bounded strings and arrays, many of them: a sequence stays inside the grammar for the whole measurement.
SCHEMA = {"type": "object", "properties": {f"field_{i}": {"type": "string", "maxLength": 40} for i in range(40)},
          "required": [f"field_{i}" for i in range(40)], "additionalProperties": False}


def tokenizer(vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = Path(__file__).resolve().parents[1]
    files = [str(p) for p in [*root.glob("src/**/*.py"), *root.glob("docs/*.md"), *root.glob("tests/**/*.py")]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["</s>"], show_progress=False,
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def decode_steps(engine: Engine, steps: int) -> list[float]:
    """Seconds of each of `steps` steps once every sequence decodes (its prompt done)."""
    while any(s.computed < len(s.prompt) for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def batch(model: Llama, params: SamplingParams, n: int, threads: int) -> Engine:
    engine = Engine(model, EngineConfig(block_size=16, kv_cache_mb=128, max_seqs=n), threads=threads)
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        prompt = torch.randint(0, model.vocab_size, (24,), generator=g).tolist()
        engine.submit(prompt, SamplingParams(**{**params.__dict__, "seed": i}))
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tok = tokenizer(a.vocab)
    vocab = tok.get_vocab_size()
    torch.manual_seed(0)
    model = Llama(vocab_size=vocab, context=2048, width=256, heads=4, layers=4, kv_heads=2, hidden=704).eval()
    grammars = Grammars(tok.to_str(), vocab, frozenset({tok.token_to_id("</s>")}))
    plain = SamplingParams(max_tokens=a.steps + 8, temperature=1.0, stop_ids=frozenset({tok.token_to_id("</s>")}))
    masked = SamplingParams(**{**plain.__dict__, "grammar": grammars.factory("json_schema", SCHEMA)})
    params = sum(p.numel() for p in model.parameters())
    print(f"random Llama {params / 1e6:.1f} M parameters, vocabulary {vocab}, {a.batch} sequences, {a.threads} thread(s); "
          f"load average before: {os.getloadavg()[0]:.2f}")
    rows = {"unmasked": [], "unmasked again (A/A)": [], "masked": []}
    for _ in range(a.repeats):
        for name, p in (("unmasked", plain), ("masked", masked), ("unmasked again (A/A)", plain)):
            rows[name] += decode_steps(batch(model, p, a.batch, a.threads), a.steps)
    base = statistics.median(rows["unmasked"])
    for name, times in rows.items():
        print(f"{name:>22}: median step {statistics.median(times) * 1e3:7.2f} ms  ({statistics.median(times) / base:.3f} x)")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
