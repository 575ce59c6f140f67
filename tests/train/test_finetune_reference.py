"""Fine-tuning a Hugging Face Llama on chat data, checked against a reference written by hand, with nothing beyond
plait's own dependencies: full fine-tuning, LoRA (q/v and every linear layer) and QLoRA (nf4) give, at every step,
the loss of a loop that runs transformers' LlamaForCausalLM from the same directory on the same global batches, with
the adapters written out (W x + alpha / r B A x, A from plait's initial A, B zero; QLoRA's bases bitsandbytes' nf4
round trip), torch's AdamW and the loss as TRL and torchtune take it: the summed cross-entropy of the batch's trained
tokens over their number (`train.loss_normalization = "tokens"`). plait accumulates two micro-batches per step, the
reference takes the batch whole. At dp2 + ZeRO-3 the token-normalised run follows the one-process run; what the
option refuses is refused before launch. tests/train/test_finetune_peers.py compares the same runs with TRL and
torchtune themselves where their venvs exist.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import assert_follows, params_after, rank0_params, step_losses
from hf_helpers import llama_dir
from plait.config import load_config
from plait.data.sampler import make_sampler
from plait.data.sources import build_data
from plait.errors import ConfigError
from plait.train.job import check_job

STEPS, BATCH, MICRO = 3, 8, 4
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
METHODS = {"full": ([], 1e-3), "lora-qv": (["q_proj", "v_proj"], 1e-2), "lora-all": (ALL, 1e-2),
           "qlora": (ALL, 1e-2)}
WORDS = "the cat sat on the mat and the dog ran to the park where a bird sang in the tree".split()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("ft")
    llama_dir(root / "llama")
    rng = random.Random(3)

    def text() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 14)))

    (root / "chat.jsonl").write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": text()}, {"role": "assistant", "content": text()}]}) + "\n" for _ in range(40)))
    return root


def sets(root, method: str, *more: str) -> list[str]:
    targets, lr = METHODS[method]
    out = [f"train.init_from='{root / 'llama'}'", "data.name='chat'", f"data.path='{root / 'chat.jsonl'}'",
           "train.loss_normalization='tokens'", "parallel.dp=1", f"train.steps={STEPS}",
           f"train.global_batch_size={BATCH}", f"train.micro_batch_size={MICRO}", "model.context=48",
           "optim.name='adamw'", f"optim.lr={lr}", "optim.betas=[0.9, 0.95]", "optim.eps=1e-8", "optim.weight_decay=0",
           "optim.grad_clip=0", "optim.warmup_steps=0", "optim.schedule='constant'", "log.every=1",
           "train.eval_samples=0", "train.sample_tokens=0", "log.progress=false", "log.report=false",
           "checkpoint.every=0"]
    if targets:
        out += ["finetune.lora_rank=8", "finetune.lora_alpha=16", f"finetune.lora_targets={targets}"]
    if method == "qlora":
        out.append("finetune.quantize_base='nf4'")
    return [*out, *more]


class HandLoRA(nn.Module):
    """y = W x + alpha / r B A x, W frozen (QLoRA: W through nf4 and back)."""

    def __init__(self, base: nn.Linear, a: torch.Tensor, alpha: float, nf4: bool):
        super().__init__()
        w = base.weight.detach()
        if nf4:
            import bitsandbytes.functional as bnbf

            q, state = bnbf.quantize_4bit(w.float().contiguous(), blocksize=64, quant_type="nf4")
            w = bnbf.dequantize_4bit(q, quant_state=state).reshape(w.shape)
        self.register_buffer("w", w.clone())
        self.a = nn.Parameter(a.clone())
        self.b = nn.Parameter(torch.zeros(w.shape[0], a.shape[0]))
        self.scale = alpha / a.shape[0]

    def forward(self, x):
        return F.linear(x, self.w) + self.scale * F.linear(F.linear(x, self.a), self.b)


def reference_losses(root, method: str, cfg, initial: dict) -> list[float]:
    """The reference loop: transformers' model, hand-written adapters, AdamW, the batch's token mean."""
    from transformers import LlamaForCausalLM

    targets, lr = METHODS[method]
    model = LlamaForCausalLM.from_pretrained(root / "llama", dtype=torch.float32, attn_implementation="eager")
    model.requires_grad_(not targets)
    for i, layer in enumerate(model.model.layers):
        for name in targets:
            owner = layer.self_attn if name in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp
            part = "attn" if owner is layer.self_attn else "mlp"
            setattr(owner, name, HandLoRA(getattr(owner, name), initial[f"blocks.{i}.{part}.{name}.lora_A"], 16,
                                          method == "qlora"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0)
    bundle = build_data(cfg.data, cfg.model)
    sampler = make_sampler(bundle.train, BATCH, cfg.train.seed)
    out = []
    for step in range(STEPS):
        x, y = bundle.train.fetch(sampler.global_batch(step))
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / (y != -100).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def plaits_initial_a(cfg) -> dict:
    from plait.runtime import single_process
    from plait.train.build import model_for

    layout = check_job(cfg)
    model, _ = model_for(cfg, layout, single_process(), build_data(cfg.data, cfg.model).spec)
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k.endswith(".lora_A")}


@pytest.mark.parametrize("method", list(METHODS))
def test_each_method_is_the_hand_written_loop(root, method):
    cfg = load_config(None, sets(root, method))
    check_job(cfg)
    initial = plaits_initial_a(cfg) if METHODS[method][0] else {}
    params_after(cfg, root / method)
    ours = [loss for loss, _ in step_losses(root / method)]
    ref = reference_losses(root, method, cfg, initial)
    gap = max(abs(a - b) for a, b in zip(ours, ref, strict=True))
    print(f"{method}: max |plait - by hand| over {STEPS} steps = {gap:.2e}; plait {ours}; by hand {ref}")
    assert gap <= 1e-5, (ours, ref)
    assert max(ours) - min(ours) > 1e-3  # the steps moved the model: equal trajectories, not one starting point
    if method == "lora-all":  # every linear layer of both blocks carries an adapter
        assert len(initial) == 2 * len(ALL)


def test_micro_batches_add_up_to_the_global_token_mean():
    """A micro-batch's loss is its rows' mean summed loss over the global batch's trained tokens per row, so the
    strategies' scaling by the micro-batch's share of rows gives the global sum over the global count: not the mean
    of the rows' means (rows here train on 1 to 8 tokens). Outside a step a batch is its own global batch."""
    from plait.train.loss import TokenMeanLoss, masked_lm_loss

    torch.manual_seed(0)
    logits, y = torch.randn(8, 10, 7), torch.randint(0, 7, (8, 10))
    for r in range(8):
        y[r, r + 1:] = -100  # row r trains on r + 1 tokens
    whole = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / (y != -100).sum()
    loss = TokenMeanLoss((y != -100).sum(1))
    loss.order = lambda step: torch.arange(8)
    loss.on_step_begin(0)
    parts = sum(loss(logits[i:i + 4], y[i:i + 4]) * (4 / 8) for i in (0, 4))
    assert torch.allclose(parts, whole, rtol=1e-6, atol=0)
    assert abs(float(masked_lm_loss(logits, y) - whole)) > 1e-2
    loss.on_step_end(1)
    assert torch.allclose(loss(logits, y), whole, rtol=1e-6, atol=0)


def test_tokens_at_dp2_zero3_follows_one_process(root, pool2, tmp_path):
    """The global batch's tokens per row come from the sampler's indices: the same on every rank, so a rank's
    micro-batches (2 rows here, one per accumulation step) add up to the one-process loss and gradient."""
    sgd = ["optim.name='sgd'", "optim.momentum=0", "optim.lr=0.05"]
    one = load_config(None, sets(root, "lora-all", *sgd))
    ref = params_after(one, root / "one-sgd"), step_losses(root / "one-sgd")
    cfg = load_config(None, sets(root, "lora-all", *sgd, "parallel.dp=2", "parallel.zero=3",
                                 "train.micro_batch_size=2"))
    got = pool2.run(rank0_params, cfg, tmp_path / "run")[0]
    assert_follows(ref, got, tmp_path / "run", STEPS, rel=1e-5, atol=1e-5)


@pytest.mark.parametrize("more, says", [
    (["data.name='text'"], "normalises the chat loss over the trained tokens"),
    (["parallel.cp=2"], "untested with parallel.cp > 1"),
])
def test_what_tokens_refuses(root, more, says):
    with pytest.raises(ConfigError, match=says):
        check_job(load_config(None, sets(root, "full", *more)))
