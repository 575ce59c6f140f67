"""Fine-tuning a Llama with plait, TRL's SFTTrainer and torchtune's recipes on the same checkpoint and the same batches:
the same losses (tests/train/test_finetune_peers.py) and the speed and memory of each (this script, and `make bench`'s
finetune group).

    .venv/bin/python benchmarks/finetune_vs_peers.py [--steps 12] [--warmup 2] [--width 256] [--layers 4]
        [--methods full,lora-all,qlora] [--worlds 1,2] [--repeats 1] [--json runs/finetune_vs_peers.json]

**The model and the data.** One transformers LlamaForCausalLM with random weights, saved with save_pretrained, its BPE
tokenizer and chat template beside it (made here, in plait's venv), and one chat JSONL of user / assistant turns of
varied lengths. The Linear weights of the blocks are drawn on the NF4 grid: each 64-value block is 16 NormalFloat
levels times its scale, holds a +-1 level, and the scales follow a pattern that torchao's double quantization (int8
scales of scales, 256 per group) stores exactly, so bitsandbytes' nf4 (plait, TRL), and torchao's NF4Tensor
(torchtune) all hold these weights and QLoRA compares training rather than quantizers (torchao's table keeps four
decimals of the levels: a few 1e-5 of a weight's value).

**The same batches in the same order.** plait's chat data turns each conversation into token ids and a trained flag
per token (the assistant turns, through the chat template); plait's sampler gives each step's global batch (indices
into the training split). The peers are given exactly those ids, in that order: per row, input_ids (the whole
conversation) and labels (the ids, -100 where plait's target is -100), steps x batch rows, each peer reading them in
order (TRL: a SequentialSampler over the rows; torchtune: its dataset component with shuffle false). plait's rows
are checked against them before anything runs. The loss is normalised as both peers do it, over the batch's trained
tokens: plait's `train.loss_normalization = "tokens"`.

**Each side.** fp32, AdamW (betas 0.9/0.95, eps 1e-8, no decay, no clipping, constant rate), no dropout:
    plait      plait train (one process; dp2: parallel.dp=2, parallel.zero=3, FSDP2)
    trl        SFTTrainer (one process; dp2: torchrun, Accelerate's FSDP2 full_shard in the Trainer)
    torchtune  tune run full/lora_finetune_single_device (dp2: *_distributed, FSDP2), device=cpu
LoRA r 8 alpha 16 on every linear layer (lora-all) or q/v (lora-qv); QLoRA: the same with nf4 bases.

**What is measured.** tokens/s: the steps' non-padding input tokens over their wall time, steps after --warmup, from
each side's own per-step times (plait: metrics.jsonl; TRL: a TrainerCallback's step ends; torchtune: its metric
logger's calls); peak RSS: the largest process's ru_maxrss over the run (loading included; under dp2, the largest
rank). Each side runs in its own venv and processes, one after another, OMP_NUM_THREADS=1 per process; a side whose
venv is missing is skipped with the command that makes it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = {"trl": (ROOT / ".venv-trl", 'python3 -m venv .venv-trl && .venv-trl/bin/pip install "torch==2.13.0" && '
                                     '.venv-trl/bin/pip install trl peft "bitsandbytes==0.50.2"', "import trl"),
         "torchtune": (ROOT / ".venv-torchtune", 'python3 -m venv .venv-torchtune && .venv-torchtune/bin/pip install '
                                                 '"torch==2.13.0" && .venv-torchtune/bin/pip install torchtune '
                                                 '"torchao==0.15.0"', "import torchtune")}
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
METHODS = {"full": [], "lora-qv": ["q_proj", "v_proj"], "lora-all": ALL_LINEAR, "qlora": ALL_LINEAR}
RANK, ALPHA = 8, 16
SPECIAL = ["[UNK]", "<s>", "</s>", "<|user|>", "<|assistant|>"]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% if m['role'] == 'assistant' %}"
            "{{ eos_token }}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
WORDS = ("the cat sat on the mat and the dog ran to the park where a bird sang in the tree while children played "
         "with a red ball near the old stone wall").split()


def peer_python(peer: str) -> Path:
    return PEERS[peer][0] / "bin" / "python"


def missing(peer: str) -> str | None:
    """None where the peer's venv imports it; else the command that makes it."""
    venv, install, probe = PEERS[peer]
    py = venv / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", probe], capture_output=True, cwd=ROOT).returncode == 0:
        return None
    return f"{peer} lives in {venv.name}, which is missing or broken here: {install}"


# ---------------------------------------------------------------------------------------------------------------
# the checkpoint and the data

def nf4_grid_(weight, gen) -> None:
    """Overwrite a Linear weight (out, in; in a multiple of 256) with values every NF4 quantizer stores exactly: per
    64-value block a level of bitsandbytes' table times the block's scale, the first value +-1 x scale; the scales
    m + k u with k = -128, 64, 32, 32 along each row (mean m, so torchao's scales-of-scales are exact int8 steps)."""
    import bitsandbytes.functional as bnbf
    import torch

    out, inp = weight.shape
    levels = bnbf.get_4bit_type("nf4", device="cpu").float()
    codes = torch.randint(0, 16, (out, inp // 64, 64), generator=gen)
    codes[:, :, 0] = torch.where(torch.rand(out, inp // 64, generator=gen) < 0.5, 0, 15)  # -1 and +1
    k = torch.tensor([-128.0, 64.0, 32.0, 32.0]).repeat(inp // 256)
    scales = (2.0 ** -4 + k * 2.0 ** -12).expand(out, -1)
    weight.copy_((levels[codes] * scales[..., None]).reshape(out, inp))


def model_dir(d: Path, width: int = 256, layers: int = 2, heads: int = 8, kv_heads: int = 4, ffn: int = 512,
              seed: int = 0) -> Path:
    """A random LlamaForCausalLM (blocks' Linear weights on the NF4 grid), its BPE tokenizer and chat template."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    if (d / "config.json").exists():
        return d
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS) * 30], trainers.BpeTrainer(vocab_size=120, special_tokens=SPECIAL))
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=width, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024,
                      bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>"), pad_token_id=None,
                      tie_word_embeddings=False, rope_theta=10000.0)
    model = LlamaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("model.layers.") and p.dim() == 2:
                nf4_grid_(p, gen)
            elif p.dim() == 2:  # the embedding (normalised before use) and the head
                p.normal_(0.0, 1.0 if "embed" in name else 0.05, generator=gen)
    model.save_pretrained(d)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": TEMPLATE, "eos_token": "</s>", "bos_token": "<s>", "model_max_length": 1024,
        "clean_up_tokenization_spaces": False, "tokenizer_class": "PreTrainedTokenizerFast"}))
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    return d


def chat_file(path: Path, n: int = 64, longest: int = 24, seed: int = 1) -> Path:
    """Conversations of one user turn and one assistant turn, each of 2..longest words."""
    rng = random.Random(seed)

    def text() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, longest)))

    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": text()},
                                                     {"role": "assistant", "content": text()}]}) + "\n"
                            for _ in range(n)))
    return path


def plait_sets(model: Path, data: Path, method: str, steps: int, batch: int, micro: int, lr: float, context: int,
               world: int = 1) -> list[str]:
    """plait's overrides for one run: fp32 AdamW as the peers run it, token-normalised loss, no evaluation."""
    sets = [f"train.init_from='{model}'", "data.name='chat'", f"data.path='{data}'", "data.val_fraction=0.05",
            "train.loss_normalization='tokens'", f"train.steps={steps}", f"train.global_batch_size={batch}",
            f"train.micro_batch_size={micro}", f"model.context={context}", "optim.name='adamw'", f"optim.lr={lr}",
            "optim.betas=[0.9, 0.95]", "optim.eps=1e-8", "optim.weight_decay=0", "optim.grad_clip=0",
            "optim.warmup_steps=0", "optim.schedule='constant'", "log.every=1", "train.eval_samples=0",
            "train.sample_tokens=0", "log.progress=false", "log.report=false", "checkpoint.every=0",
            f"parallel.dp={world}", f"parallel.zero={3 if world > 1 else 0}"]
    if METHODS[method]:
        sets += [f"finetune.lora_rank={RANK}", f"finetune.lora_alpha={ALPHA}", f"finetune.lora_targets={METHODS[method]}"]
    if method == "qlora":
        sets.append("finetune.quantize_base='nf4'")
    return sets


def encoded(cfg) -> list:
    """(ids, trained) of each training example, as plait's chat data makes them (its held-out split left out)."""
    from plait.data.chat import _token_text, encode, pieces, read_examples, split, template_of, tokenizer_config
    from plait.data.hf_tokenizer import HFTokenizer

    config = tokenizer_config(cfg.data.tokenizer)
    template, eos = template_of(config, cfg.data.tokenizer), _token_text(config.get("eos_token"))
    tok = HFTokenizer.from_file(cfg.data.tokenizer)
    examples = read_examples(Path(cfg.data.path))
    held = split(len(examples), cfg.data.val_fraction)
    return [encode(tok, pieces(w, ex, template, eos)) for i, (w, ex) in enumerate(examples) if i not in held]


def rows_in_order(cfg, steps: int) -> list[dict]:
    """Each step's global batch, in order, as the peers take it: per row its whole conversation's ids (input_ids) and
    labels (the ids where plait trains on the next token, -100 elsewhere), checked against plait's own rows."""
    import numpy as np

    from plait.data.sampler import make_sampler
    from plait.data.sources import build_data

    train = encoded(cfg)
    bundle = build_data(cfg.data, cfg.model)
    sampler = make_sampler(bundle.train, cfg.train.global_batch_size, cfg.train.seed)
    out = []
    for s in range(steps):
        for i in sampler.global_batch(s).tolist():
            ids, trained = train[i]
            assert len(ids) <= cfg.model.context + 1, "the rows are not cut (a longer model.context)"
            x, y = bundle.train.x[i], bundle.train.y[i]
            n = len(ids) - 1
            labels = np.where(trained, ids, -100)
            assert x[:n].tolist() == ids[:-1].tolist() and y[:n].tolist() == labels[1:].tolist(), i
            out.append({"input_ids": ids.tolist(), "labels": [-100, *labels[1:].tolist()]})
    return out


def initial_a(cfg) -> dict:
    """plait's starting lora_A of each adapted layer, by plait's name (the peers map it onto theirs)."""
    from plait.data.sources import build_data
    from plait.runtime import single_process
    from plait.train.build import model_for
    from plait.train.job import check_job

    layout = check_job(cfg)
    model, _ = model_for(cfg, layout, single_process(), build_data(cfg.data, cfg.model).spec)
    return {k: v.tolist() for k, v in model.state_dict().items() if k.endswith(".lora_A")}


def job_run(name: str, cfg, method: str, steps: int, lr: float, world: int = 1, with_a: bool = True,
            exact_levels: bool = True) -> dict:
    """One run of a peer's job: its rows in plait's order and, for LoRA, plait's initial A; exact_levels: torchtune's
    NF4 tensors decode with bitsandbytes' levels (finetune_peer_torchtune.bnb_levels)."""
    run = {"name": name, "method": "full" if method == "full" else ("qlora" if method == "qlora" else "lora"),
           "lr": lr, "batch": cfg.train.global_batch_size, "rows": rows_in_order(cfg, steps), "world": world,
           "fsdp": world > 1, "exact_levels": exact_levels}
    if METHODS[method]:
        run["lora"] = {"r": RANK, "alpha": ALPHA, "targets": METHODS[method], "A": initial_a(cfg) if with_a else {}}
    return run


def run_peer(peer: str, job: dict, work: Path, world: int = 1, timeout: float = 1800) -> dict:
    """The peer's answer to a job (its own venv and processes)."""
    script = Path(__file__).with_name(f"finetune_peer_{peer}.py")
    (work / f"{peer}-job.json").write_text(json.dumps(job))
    answer = work / f"{peer}-answer.json"
    cmd = [str(peer_python(peer)), str(script), str(work / f"{peer}-job.json"), str(answer)]
    if peer == "trl" and world > 1:  # Accelerate (inside the Trainer) takes its ranks from torchrun's variables
        cmd = [str(peer_python(peer).with_name("torchrun")), "--standalone", "--nproc_per_node", str(world), *cmd[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=work, env=env)
    if r.returncode:
        raise RuntimeError(f"{peer} failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-5000:]}")
    return json.loads(answer.read_text())


# ---------------------------------------------------------------------------------------------------------------
# speed and memory

SIDES = ("plait", "trl", "torchtune")
# what a peer cannot run here, and why (measured: the recipes' own errors on this CPU build of torch)
UNSUPPORTED = {("torchtune", 2): "torchtune 0.6.1's distributed recipes stop on a CPU: full_finetune_distributed at "
                                 "'ValueError: Logging memory stats is not supported on CPU devices' (it logs them on "
                                 "rank 0 whatever log_peak_memory_stats says), lora_finetune_distributed at "
                                 "init_process_group('cuda:nccl,cpu:gloo'): 'RuntimeError: Distributed package "
                                 "doesn't have NCCL built in'"}


def runs(side: str, world: int) -> bool:
    return (side, world) not in UNSUPPORTED


def longest(model: Path, data: Path) -> int:
    """The longest conversation's tokens: plait's rows are that long less one (the peers pad each batch to its own)."""
    from plait.config import load_config
    from plait.train.job import check_job

    cfg = load_config(None, plait_sets(model, data, "full", 1, 1, 1, 1e-3, 1000))  # model.context: not its default
    check_job(cfg)
    return max(len(ids) for ids, _ in encoded(cfg))


def setup(a, work: Path) -> dict:
    """The checkpoint, the data and, per (method, world), plait's overrides and the peers' job."""
    from plait.config import load_config
    from plait.train.job import check_job

    model = model_dir(work / "llama", a.width, a.layers, a.heads, a.kv_heads, 2 * a.width)
    data = chat_file(work / "chat.jsonl", n=max(64, a.batch * (a.steps + 2)), longest=a.words)
    context = longest(model, data) - 1
    context += context == 128  # model.context's default is 'the checkpoint's' (plait.models.hf)
    cells = {}
    for method in a.methods:
        for world in a.worlds:
            sets = plait_sets(model, data, method, a.steps, a.batch, a.batch // world, a.lr, context, world)
            cfg = load_config(None, sets)
            check_job(cfg)
            cells[f"{method}/dp{world}"] = {"sets": sets, "job": job_run(method, cfg, method, a.steps, a.lr, world,
                                                                          with_a=False)}
    return {"model": str(model), "work": work, "cells": cells, "warmup": a.warmup, "n": 0}


def rate(tokens: list[int], seconds: list[float], warmup: int) -> float:
    return sum(tokens[warmup:]) / sum(seconds[warmup:])


def measure_plait(cell: dict, ctx: dict) -> tuple[float, int]:
    ctx["n"] += 1
    out = ctx["work"] / f"plait-{ctx['n']}"
    sets = [x for s in cell["sets"] for x in ("--set", s)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    r = subprocess.run([str(Path(sys.executable).with_name("plait")), "train", *sets, "--out", str(out)],
                       capture_output=True, text=True, env=env)
    if r.returncode:
        raise RuntimeError(f"plait train failed ({r.returncode}):\n{r.stderr[-4000:]}")
    steps = [m["step_time_s"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
             if "step_time_s" in m]
    rows = cell["job"]["rows"]
    batch = cell["job"]["batch"]
    tokens = [sum(len(x["input_ids"]) for x in rows[s:s + batch]) for s in range(0, len(rows), batch)]
    summary = json.loads((out / "summary.json").read_text())
    return rate(tokens, steps, ctx["warmup"]), max(r["peak_rss_bytes"] for r in summary["memory"]["per_rank"])


def measure(side: str, ctx: dict) -> dict[str, float]:
    """{tok_s@cell, rss@cell} of one side over every cell."""
    got = {}
    for name, cell in ctx["cells"].items():
        if not runs(side, cell["job"]["world"]):
            continue
        if side == "plait":
            tok_s, rss = measure_plait(cell, ctx)
        else:
            job = {"model": ctx["model"], "runs": [cell["job"]]}
            answer = run_peer(side, job, ctx["work"], cell["job"]["world"])[cell["job"]["name"]]
            seconds = [b - a for a, b in zip([0.0, *answer["ends"]], answer["ends"])]
            tok_s, rss = rate(answer["tokens"], seconds, ctx["warmup"]), answer["peak_rss"]
        got[f"tok_s@{name}"], got[f"rss@{name}"] = tok_s, float(rss)
    return got


def args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the rate (each side's first steps)")
    ap.add_argument("--batch", type=int, default=16, help="global batch: rows per step")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--words", type=int, default=48, help="the longest turn, in words")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--methods", default="full,lora-all,qlora")
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", default="runs/finetune_vs_peers.json")
    a = ap.parse_args(argv)
    a.methods, a.worlds = a.methods.split(","), [int(w) for w in a.worlds.split(",")]
    unknown = sorted(set(a.methods) - set(METHODS))
    if unknown:
        ap.error(f"--methods {unknown}: choose from {', '.join(METHODS)}")
    return a


def main(argv=None) -> int:
    a = args(argv)
    sides = [s for s in SIDES if s == "plait" or not missing(s)]
    for s in SIDES:
        if s not in sides:
            print(f"{s}: skipped, {missing(s)}", flush=True)
    got: dict[str, list] = {s: [] for s in sides}
    with tempfile.TemporaryDirectory() as tmp:
        ctx = setup(a, Path(tmp))
        for r in range(a.repeats):
            for side in sides[r % len(sides):] + sides[:r % len(sides)]:
                t0 = time.perf_counter()
                got[side].append(measure(side, ctx))
                print(f"repeat {r + 1} {side}: {time.perf_counter() - t0:.0f} s", flush=True)
    lines = ["| method | processes | side | tokens/s | peak RSS MB | tokens/s: plait / side | RSS: plait / side |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for cell in ctx["cells"]:
        method, world = cell.split("/dp")
        med = {s: (statistics.median(g[f"tok_s@{cell}"] for g in got[s]),
                   statistics.median(g[f"rss@{cell}"] for g in got[s])) for s in sides if runs(s, int(world))}
        for s in med:
            lines.append(f"| {method} | {world} | {s} | {med[s][0]:.0f} | {med[s][1] / 1e6:.0f} | "
                         f"{med['plait'][0] / med[s][0]:.2f} | {med['plait'][1] / med[s][1]:.2f} |")
    table = "\n".join(lines)
    skipped = "".join(f"\n{s} at dp{w}: not run, {why}" for (s, w), why in UNSUPPORTED.items() if w in a.worlds)
    print(f"\n{table}\n{skipped}\n\nload average {os.getloadavg()[0]:.2f} at the end")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({"args": vars(a), "measured": got, "load": os.getloadavg()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
