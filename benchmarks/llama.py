"""plait's llama next to transformers' LlamaForCausalLM: the same configuration, data and steps, one process on CPU.

    plait        plait's trainer with model.name = "llama" (plait.models.llama)
    hf-factory   plait's trainer with model.factory = a LlamaForCausalLM of the same shapes (SDPA attention)
    hf-bare      that LlamaForCausalLM in a bare torch loop: forward, cross-entropy, backward, AdamW step

Each variant runs in a fresh process (so its peak RSS is its own: ru_maxrss), on the same char-level corpus
(the standard library's text, data.name = "stdlib-text"), global batch --batch of --seq tokens, AdamW
lr 1e-3, fp32, OMP threads --threads. Step time is the median over the steps after --warmup (plait: its
metrics.jsonl step_time_s, logged every step; bare: the same span around one step). The ratio column is
against hf-bare, measured in the same run. Target (docs, issue 31): plait <= 1.0x the transformers model.

    .venv/bin/python benchmarks/llama.py [--steps 12] [--warmup 3] [--width 384] [--layers 6] [--seq 256]
        [--batch 4] [--json runs/llama_bench.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = ("plait", "hf-factory", "hf-bare")


def hf_model(width: int, layers: int, heads: int, kv_heads: int, hidden: int, vocab: int, context: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=context,
                         tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def shapes(a) -> dict:
    return {"width": a.width, "layers": a.layers, "heads": a.heads, "kv_heads": a.kv_heads, "hidden": a.hidden}


def run_plait(a, variant: str, out: Path) -> list[float]:
    from plait.config import load_config
    from plait.data import build_data
    from plait.train.trainer import train

    sets = [f"model.context={a.seq}", f"train.global_batch_size={a.batch}", f"train.micro_batch_size={a.batch}",
            f"train.steps={a.steps}", "optim.name=adamw", "optim.lr=1e-3", "optim.warmup_steps=0", "log.every=1",
            "log.progress=false", "log.report=false", "checkpoint.every=0", "train.sample_tokens=0",
            "train.eval_samples=0", "parallel.dp=1"]
    cfg = load_config(None, sets)
    vocab = build_data(cfg.data, cfg.model).spec.vocab_size
    if variant == "plait":
        sets += ["model.name=llama", "model.tie_embeddings=false", "model.vocab_multiple=1",
                 *(f"model.{k}={v}" for k, v in shapes(a).items())]
    else:
        opts = {**shapes(a), "vocab": vocab, "context": a.seq}
        table = ", ".join(f"{k} = {v}" for k, v in opts.items())
        sets += ["model.factory='llama:hf_model'", f"model.options={{{table}}}"]
    train(load_config(None, sets), out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in rows if "step_time_s" in r]


def run_bare(a) -> list[float]:
    import torch
    import torch.nn.functional as F

    from plait.config import load_config
    from plait.data import build_data

    cfg = load_config(None, [f"model.context={a.seq}"])
    bundle = build_data(cfg.data, cfg.model)
    tokens = torch.as_tensor(bundle.train.tokens[: a.steps * a.batch * (a.seq + 1)])
    model = hf_model(vocab=bundle.spec.vocab_size, context=a.seq, **shapes(a)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for step in range(a.steps):
        t0 = time.perf_counter()
        chunk = tokens[step * a.batch * (a.seq + 1):(step + 1) * a.batch * (a.seq + 1)].view(a.batch, a.seq + 1).long()
        logits = model(chunk[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


def child(a) -> None:
    import torch

    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        times = run_bare(a) if a.child == "hf-bare" else run_plait(a, a.child, Path(tmp) / "run")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"times": times, "peak_rss": peak}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a)
    here = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": f"{here}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": str(a.threads)}
    results = {}
    for v in VARIANTS:
        args = [sys.executable, __file__, "--child", v] + [x for x in sys.argv[1:] if x != "--json" and not x.endswith(".json")]
        proc = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
        if proc.returncode:
            results[v] = {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        r["median_step_s"] = statistics.median(r["times"][a.warmup:])
        results[v] = r
    base = results.get("hf-bare", {}).get("median_step_s")
    params = sum(t.numel() for t in hf_model(vocab=128, context=a.seq, **shapes(a)).parameters())
    print(f"llama {params / 1e6:.1f}M parameters (vocab 128), {a.seq} tokens x {a.batch}, {a.steps} steps "
          f"(median after {a.warmup}), {a.threads} threads, load average {os.getloadavg()[0]:.2f}")
    print(f"{'variant':<12} {'step s':>8} {'x hf-bare':>10} {'peak RSS MB':>12}")
    for v, r in results.items():
        if "error" in r:
            print(f"{v:<12} error: {r['error']}")
            continue
        ratio = f"{r['median_step_s'] / base:.2f}" if base else "-"
        print(f"{v:<12} {r['median_step_s']:>8.3f} {ratio:>10} {r['peak_rss'] / 2**20:>12.0f}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "results": results}, indent=1))


if __name__ == "__main__":
    main()
