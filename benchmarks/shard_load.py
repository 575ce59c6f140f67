"""Sharded loading: each rank's peak resident memory while `train.init_from` reads a Hugging Face Llama checkpoint.

    N = 1   one process loads the whole checkpoint into the plain model (plait.models.meta.materialize from a
            meta-device build: the same reads, no sharding)
    N = 2,4 ZeRO-3 over N ranks with parallel.shard_init (the default): the model is built on the meta device,
            FSDP2 shards it, and each rank reads only its own rows of every tensor (safetensors' get_slice)

Every rank is a fresh process (plait.testing.RankPool). "grew" is the rise of the process's resident memory
(VmHWM after the load, the high-water mark reset before it, freed heap handed back first) over its value before;
the bound is the one tests/parallel/test_shard_load.py asserts: S/N + 2 x (largest tensor)/N + 16 MiB.

    .venv/bin/python benchmarks/shard_load.py [--ranks 1,2,4] [--width 512] [--layers 4] [--vocab 16000]
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path

OVERHEAD = 16 * 2**20


def make_checkpoint(d: Path, a) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=a.vocab, hidden_size=a.width, intermediate_size=3 * a.width,
                         num_hidden_layers=a.layers, num_attention_heads=a.width // 64,
                         num_key_value_heads=a.width // 128, max_position_embeddings=64, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.02)
    model.save_pretrained(d)
    return d


def sets(checkpoint: Path, corpus: Path, n: int) -> list[str]:
    return [f"train.init_from='{checkpoint}'", "data.name='text'", f"data.path='{corpus}'", "data.min_char_count=1",
            "model.context=32", "train.steps=1", f"train.global_batch_size={n}", "train.micro_batch_size=1",
            "train.eval_samples=0", "train.sample_tokens=0", "log.progress=false", "log.report=false",
            "checkpoint.every=0", f"parallel.dp={n}", f"parallel.zero={3 if n > 1 else 0}"]


def load_rank(overrides: list[str], run_dir: str) -> dict:
    """Pool task: the load's figures on this rank."""
    import torch

    from plait.config import load_config
    from plait.data import build_data
    from plait.models import build_model
    from plait.models.meta import build_on_meta, materialize
    from plait.train.job import check_job
    from plait.train.trainer import train
    from plait.train.weights import checkpoint_parts

    cfg = load_config(None, overrides)
    if cfg.parallel.dp > 1:
        return train(cfg, run_dir).strategy.init_memory
    check_job(cfg)
    spec = build_data(cfg.data, cfg.model).spec
    module, _ = build_on_meta(lambda: build_model(cfg.model, spec))
    return materialize(module, checkpoint_parts(cfg.train.init_from, module), torch.device("cpu"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=16000)
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from safetensors import safe_open

    from plait.testing import RankPool

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt = make_checkpoint(tmp / "llama", a)
        corpus = tmp / "corpus"
        corpus.mkdir()
        (corpus / "a.txt").write_text("".join(chr(32 + i % 90) for i in range(20_000)))
        with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
            sizes = [f.get_slice(k).get_shape() for k in f.keys()]
        numel = [math.prod(s) for s in sizes]
        size, largest = 4 * sum(numel), 4 * max(numel)
        mib = 2**20
        print(f"checkpoint: {size / mib:.1f} MiB fp32 in {len(sizes)} tensors (largest {largest / mib:.1f} MiB)")
        print(f"{'N':>3}{'S/N MiB':>10}{'bound MiB':>11}{'local MiB':>11}{'grew MiB (each rank)':>32}  within")
        ok = True
        for n in (int(x) for x in a.ranks.split(",")):
            with RankPool(n, timeout_s=600) as pool:
                figs = pool.run(load_rank, sets(ckpt, corpus, n), str(tmp / f"run{n}"))
            grew = [(f["peak_rss_bytes"] - f["rss_before_bytes"]) / mib for f in figs]
            bound = (size / n + 2 * largest / n + OVERHEAD) / mib
            within = max(grew) <= bound
            ok &= within
            print(f"{n:>3}{size / n / mib:>10.1f}{bound:>11.1f}{figs[0]['local_bytes'] / mib:>11.1f}"
                  f"{' '.join(f'{g:.1f}' for g in grew):>32}  {'yes' if within else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
