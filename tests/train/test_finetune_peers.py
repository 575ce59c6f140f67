"""plait's full fine-tuning, LoRA (r 8 on q/v and on every linear layer) and QLoRA (nf4) give TRL's SFTTrainer's and
torchtune's recipes' loss at every step, on one random Hugging Face Llama and one chat JSONL, fed the same rows in the
same order (fp32, plain AdamW, no clipping, no dropout, the loss over the batch's trained tokens as both peers take
it: plait's train.loss_normalization = "tokens"): within 1e-4 (measured: a few 1e-6).

Each peer runs in a venv of its own, made once, and is skipped, saying how, without it:

    python3 -m venv .venv-trl && .venv-trl/bin/pip install "torch==2.13.0" && \\
        .venv-trl/bin/pip install trl peft "bitsandbytes==0.50.2"
    python3 -m venv .venv-torchtune && .venv-torchtune/bin/pip install "torch==2.13.0" && \\
        .venv-torchtune/bin/pip install torchtune "torchao==0.15.0"

How the order is aligned, and what each side runs: benchmarks/finetune_vs_peers.py's docstring (the model, the rows
and the jobs are made there, the peers are benchmarks/finetune_peer_trl.py and finetune_peer_torchtune.py). plait's
rows are checked token for token against the ids the peers are given before anything trains.
tests/train/test_finetune_reference.py checks the same methods against a loop written by hand, with no peer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # benchmarks/ is not a package: its scripts are imported by name

import finetune_vs_peers as fp  # noqa: E402

from plait.config import load_config  # noqa: E402
from plait.train.job import check_job  # noqa: E402
from plait.train.trainer import train  # noqa: E402

STEPS, BATCH, MICRO, CONTEXT = 5, 8, 4, 64  # 64 holds the longest conversation (46 tokens)
LR = {"full": 1e-3, "lora-qv": 1e-2, "lora-all": 1e-2, "qlora": 1e-2}


@pytest.fixture(scope="module")
def plait_side(tmp_path_factory):
    """plait's losses per method, and the job each peer is given (the same rows, plait's initial adapters)."""
    root = tmp_path_factory.mktemp("peers")
    model, data = fp.model_dir(root / "llama"), fp.chat_file(root / "chat.jsonl")
    losses, job = {}, {"model": str(model), "runs": []}
    for method, lr in LR.items():
        cfg = load_config(None, fp.plait_sets(model, data, method, STEPS, BATCH, MICRO, lr, CONTEXT))
        check_job(cfg)
        job["runs"].append(fp.job_run(method, cfg, method, STEPS, lr))  # checks plait's rows against the ids
        train(cfg, root / method)
        losses[method] = [m["loss"] for m in map(json.loads, (root / method / "metrics.jsonl").read_text().splitlines())
                          if "loss" in m]
    return root, losses, job


@pytest.fixture(scope="module", params=list(fp.PEERS))
def peer(request, plait_side):
    why = fp.missing(request.param)
    if why:
        pytest.skip(why)
    root, losses, job = plait_side
    return request.param, losses, fp.run_peer(request.param, job, root)


@pytest.mark.parametrize("method", list(LR))
def test_the_loss_is_the_peers_at_every_step(peer, method):
    name, ours, answer = peer
    theirs = answer[method]["losses"]
    assert len(ours[method]) == len(theirs) == STEPS
    gap = max(abs(a - b) for a, b in zip(ours[method], theirs, strict=True))
    print(f"{method} vs {name}: max |plait - {name}| over {STEPS} steps = {gap:.2e}; plait {ours[method]}; "
          f"{name} {theirs}")
    assert gap <= 1e-4, (ours[method], theirs)
    assert ours[method][-1] < ours[method][0] - 1e-2  # the steps moved the model: equal trajectories
