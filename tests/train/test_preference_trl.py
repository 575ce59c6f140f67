"""plait's DPO and IPO give TRL's DPOTrainer's loss at every step, on the same checkpoint and the same pairs in the
same order (fp32, plain AdamW, no clipping, no dropout): within 1e-4 (measured: a few 1e-7). DPO with LoRA too: peft's
adapters start from plait's initial A (B is zero on both sides), and TRL's reference is then the base with its
adapters off, as plait's is.

TRL runs in a venv of its own (it brings datasets and accelerate, which plait does not need), made once:

    python3 -m venv .venv-trl && .venv-trl/bin/pip install "torch==2.13.0" && .venv-trl/bin/pip install trl peft

and is skipped, saying that, without it. How the order is aligned: plait's sampler gives each step's global batch
(its indices into the training split, whose rows record their line in the file: source_index); those lines' pairs,
step after step, are TRL's dataset, which its trainer reads in order (a SequentialSampler) one step's batch at a
time. Each side tokenizes the file's texts itself, and the test first checks that both made the same token ids
(TRL's prompt_ids, chosen_ids and rejected_ids against plait's), texts for DPO and conversations through the chat
template for IPO. tests/train/test_preference.py checks the losses against the papers' formulas without TRL.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from hf_helpers import llama_dir
from plait.config import load_config
from plait.data.chat import template_of, tokenizer_config
from plait.data.hf_tokenizer import HFTokenizer
from plait.data.preference import PairEncoder, read_pairs
from plait.data.sampler import make_sampler
from plait.data.sources import build_data
from plait.train.job import check_job
from plait.train.trainer import train

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-trl" / "bin" / "python"
INSTALL = 'python3 -m venv .venv-trl && .venv-trl/bin/pip install "torch==2.13.0" && .venv-trl/bin/pip install trl peft'
STEPS, BATCH, CONTEXT = 6, 8, 64
WORDS = "the cat sat on the mat and the dog ran to the park where a bird sang in the tree".split()


def pairs(conversations: bool, n: int = 48) -> list[dict]:
    """Deterministic pairs: chosen from the first words, rejected from the others, of varied lengths."""
    import random

    rng = random.Random(1)
    out = []
    for _ in range(n):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 7)))
        chosen = " ".join(rng.choice(WORDS[:8]) for _ in range(rng.randint(1, 5)))
        rejected = " ".join(rng.choice(WORDS[8:]) for _ in range(rng.randint(1, 5)))
        if conversations:
            out.append({"prompt": [{"role": "user", "content": prompt}],
                        "chosen": [{"role": "assistant", "content": chosen}],
                        "rejected": [{"role": "assistant", "content": rejected}]})
        else:
            out.append({"prompt": prompt, "chosen": " " + chosen, "rejected": " " + rejected})
    return out


RUNS = {"dpo": ("dpo", "sigmoid", False, 0.1, 5e-3), "ipo": ("ipo", "ipo", True, 0.5, 5e-3),
        "dpo-lora": ("dpo", "sigmoid", False, 0.1, 3e-2)}
LORA = ["finetune.lora_rank=4", "finetune.lora_alpha=8"]  # the default targets: q_proj, v_proj


def initial_adapters(cfg) -> dict:
    """plait's starting lora_A of each adapted layer (built as the run builds it), under peft's names for the
    transformers model: blocks.i.attn.q_proj -> base_model.model.model.layers.i.self_attn.q_proj.lora_A.default."""
    from plait.runtime import single_process
    from plait.train.build import model_for

    layout = check_job(cfg)
    model, _ = model_for(cfg, layout, single_process(), build_data(cfg.data, cfg.model).spec)
    out = {}
    for name, value in model.state_dict().items():
        if name.endswith(".lora_A"):
            block, rest = name.removeprefix("blocks.").split(".", 1)
            layer = rest.removesuffix(".lora_A").replace("attn.", "self_attn.")
            out[f"base_model.model.model.layers.{block}.{layer}.lora_A.default.weight"] = value.tolist()
    return out


def plait_run(model: Path, data: Path, objective: str, beta: float, lr: float, out: Path, lora: bool = False):
    cfg = load_config(None, [*(LORA if lora else []),
        f"train.init_from='{model}'", "data.name='preference'", f"data.path='{data}'", f"train.objective='{objective}'",
        f"train.dpo_beta={beta}", "parallel.dp=1", f"train.steps={STEPS}", f"train.global_batch_size={BATCH}",
        f"train.micro_batch_size={BATCH // 2}", f"model.context={CONTEXT}", "optim.name='adamw'", f"optim.lr={lr}",
        "optim.betas=[0.9, 0.95]", "optim.eps=1e-8", "optim.weight_decay=0", "optim.grad_clip=0",
        "optim.warmup_steps=0", "optim.schedule='constant'", "log.every=1", "train.eval_samples=0",
        "train.sample_tokens=0", "log.progress=false", "log.report=false", "checkpoint.every=0"])
    check_job(cfg)  # data.tokenizer from the checkpoint's directory; the LoRA targets resolved
    bundle = build_data(cfg.data, cfg.model)
    sampler = make_sampler(bundle.train, BATCH, cfg.train.seed)
    raw = [ex for _, ex in read_pairs(data)]
    order = [raw[int(bundle.train.source_index[i])] for s in range(STEPS) for i in sampler.global_batch(s)]
    train(cfg, out)
    losses = [m["loss"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
    return cfg, order, losses


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    if not PYTHON.exists() or subprocess.run([str(PYTHON), "-c", "import trl"], capture_output=True).returncode:
        pytest.skip(f"TRL's DPOTrainer lives in .venv-trl, which is missing here: {INSTALL}")
    root = tmp_path_factory.mktemp("trl")
    model = llama_dir(root / "llama")
    mine, job = {}, {"model": str(model), "runs": []}
    for name, (objective, loss_type, talk, beta, lr) in RUNS.items():
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(p) + "\n" for p in pairs(talk)))
        lora = name.endswith("lora")
        cfg, order, losses = plait_run(model, data, objective, beta, lr, root / name, lora)
        mine[name] = (cfg, order, losses)
        job["runs"].append({"name": name, "loss_type": loss_type, "beta": beta, "lr": lr, "max_length": CONTEXT + 1,
                            "batch": BATCH, "examples": order})
        if lora:
            job["runs"][-1]["lora"] = {"r": 4, "alpha": 8, "targets": list(cfg.finetune.lora_targets),
                                       "A": initial_adapters(cfg)}
    (root / "job.json").write_text(json.dumps(job))
    r = subprocess.run([str(PYTHON), str(Path(__file__).with_name("trl_dpo_peer.py")), str(root / "job.json"),
                        str(root / "answer.json")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return mine, json.loads((root / "answer.json").read_text())


@pytest.mark.parametrize("name", list(RUNS))
def test_both_sides_tokenize_the_pairs_alike(compared, name):
    mine, theirs = compared
    cfg, order, _ = mine[name]
    config = tokenizer_config(cfg.data.tokenizer)
    encode = PairEncoder(HFTokenizer.from_file(cfg.data.tokenizer), template_of(config, cfg.data.tokenizer),
                         config["eos_token"])
    for k, (ex, ids) in enumerate(zip(order, theirs[name]["ids"], strict=True)):
        chosen, rejected, start = encode(f"pair {k}", ex)
        assert (chosen[:start].tolist(), chosen[start:].tolist(), rejected[start:].tolist()) == (
            ids["prompt_ids"], ids["chosen_ids"], ids["rejected_ids"]), (k, ex)


@pytest.mark.parametrize("name", list(RUNS))
def test_the_loss_is_trls_at_every_step(compared, name):
    mine, theirs = compared
    ours, trl = mine[name][2], theirs[name]["losses"]
    assert len(ours) == len(trl) == STEPS
    gap = max(abs(a - b) for a, b in zip(ours, trl, strict=True))
    print(f"{name}: max |plait - TRL| over {STEPS} steps = {gap:.2e}; plait {ours}; TRL {trl}")
    assert gap <= 1e-4, (ours, trl)
    assert ours[-1] < ours[0] - 1e-3  # the steps moved the model: equal trajectories, not equal starting points
