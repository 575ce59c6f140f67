"""parallel.offload = "disk": optimizer state in memory-mapped files, updated chunk by chunk.

The trajectory is the optimizer's own (equal per-step losses and weights), peak RSS falls by about the
optimizer's bytes, and checkpoints hold the state (a run stopped half-way resumes onto the same weights).
"""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import ENV, max_diff, rank0_params, tiny_gpt_config
from plait.errors import ConfigError
from plait.parallel.offload import ChunkedOffload, DiskStore
from plait.train.job import load_job


@pytest.mark.parametrize("name, kwargs", [("adamw", {"lr": 1e-2, "weight_decay": 0.1}),
                                          ("sgd", {"lr": 0.1, "momentum": 0.9})])
def test_chunks_that_cut_across_tensors_give_the_optimizers_own_steps(tmp_path, name, kwargs):
    cls = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[name]
    torch.manual_seed(0)
    shapes = [(5, 3), (4,), (2, 7), (1,)]
    ref = [torch.randn(s, requires_grad=True) for s in shapes]
    got = [p.detach().clone().requires_grad_() for p in ref]
    plain = cls([{"params": ref[:2]}, {"params": ref[2:], "weight_decay": 0.0}], **kwargs)
    # 7 elements a chunk: pieces of one tensor land in several chunks, one chunk holds pieces of several tensors
    offloaded = ChunkedOffload(cls([{"params": got[:2]}, {"params": got[2:], "weight_decay": 0.0}], **kwargs),
                               DiskStore(tmp_path), chunk_numel=7)
    assert len(offloaded.chunks) == -(-sum(p.numel() for p in got) // 7)
    for step in range(3):
        grads = [torch.randn(s) for s in shapes]
        for opt, ps in ((plain, ref), (offloaded, got)):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            opt.param_groups[0]["lr"] = kwargs["lr"] / (step + 1)
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    # torch's state_dict format, read from the files (both ways round)
    a, b = plain.state_dict()["state"], offloaded.state_dict()["state"]
    assert a.keys() == b.keys() and all(torch.equal(a[i][k], b[i][k]) for i in a for k in a[i])
    again = ChunkedOffload(cls([{"params": got[:2]}, {"params": got[2:]}], **kwargs), DiskStore(tmp_path / "b"), 7)
    again.load_state_dict(plain.state_dict())
    assert all(torch.equal(a[i][k], again.state_dict()["state"][i][k]) for i in a for k in a[i])
    assert (tmp_path / "b").is_dir() and sorted(f.name for f in (tmp_path / "b").iterdir()) == sorted(
        f"{k}.bin" for k in again.keys)


def cfg(corpus, *more):
    return tiny_gpt_config(corpus, "parallel.dp=2", "parallel.zero=1", "train.steps=6", "checkpoint.every=3", *more)


def losses(run):
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_disk_offload_with_zero1_keeps_the_trajectory_and_resumes(pool2, tiny_text, tmp_path):
    ref = pool2.run(rank0_params, cfg(tiny_text), tmp_path / "none")[0]
    run = tmp_path / "disk"  # stopped after 3 steps, resumed from the checkpoint (which holds the offloaded state)
    pool2.run(rank0_params, cfg(tiny_text, "parallel.offload='disk'", "train.stop_after=3"), run)
    assert sorted(d.name for d in (run / "offload").iterdir()) == ["rank-0", "rank-1"]
    shutil.copytree(run, tmp_path / "plain", symlinks=True)
    got = pool2.run(rank0_params, cfg(tiny_text, "parallel.offload='disk'"), run, True)[0]
    assert max_diff(ref, got) <= 1e-6
    # the checkpoint is an ordinary one: it resumes without offload too
    assert max_diff(ref, pool2.run(rank0_params, cfg(tiny_text), tmp_path / "plain", True)[0]) <= 1e-6
    assert len(losses(run)) == 6
    assert losses(run) == pytest.approx(losses(tmp_path / "none"), abs=1e-6)
    summary = json.loads((run / "summary.json").read_text())
    per_rank = summary["memory"]["per_rank"]
    assert [m["optimizer_bytes"] for m in per_rank] == [0, 0]
    # ZeRO-1: each rank offloads the AdamW state (2 x fp32) of the parameters it owns; together, all of them
    assert sum(m["optimizer_offloaded_bytes"] for m in per_rank) == 8 * summary["params"]


RSS_SCRIPT = """
import json, sys, torch
from plait.config import load_config
from plait.train.trainer import train
cfg = load_config(None, sys.argv[2:])
result = train(cfg, None)  # no run dir: no checkpoint (a save pages the whole state in), scratch offload files
torch.save(result.strategy.full_model_state_dict(), sys.argv[1])
hwm = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024
print(json.dumps({"hwm": hwm, "loss": result.summary["final_loss"], "params": result.summary["params"]}))
"""

MLP = ["model.name='mlp'", "data.name='digits'", "model.width=2048", "model.depth=3", "parallel.dp=1",
       "train.steps=3", "train.global_batch_size=16", "train.micro_batch_size=16", "train.eval_samples=32",
       "log.progress=false", "log.report=false"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmHWM from /proc/self/status")
def test_disk_offload_lowers_peak_rss_by_about_the_optimizer_bytes(tmp_path):
    procs = {mode: subprocess.Popen([sys.executable, "-c", RSS_SCRIPT, str(tmp_path / f"{mode}.pt"), *MLP,
                                     f"parallel.offload='{mode}'"], env=ENV, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for mode in ("none", "disk")}
    runs = {}
    for mode, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        runs[mode] = json.loads(out.strip().splitlines()[-1])
    assert runs["disk"]["loss"] == runs["none"]["loss"]
    assert max_diff(torch.load(tmp_path / "none.pt"), torch.load(tmp_path / "disk.pt")) == 0.0
    optimizer_bytes = 8 * runs["none"]["params"]  # AdamW: exp_avg and exp_avg_sq, fp32
    assert optimizer_bytes > 60e6
    saved = runs["none"]["hwm"] - runs["disk"]["hwm"]
    assert saved >= 0.5 * optimizer_bytes, (saved / 1e6, optimizer_bytes / 1e6)


SHARDED = {  # layouts whose parameters are DTensors (or pipeline stages): name -> (processes, overrides)
    "zero3": (2, ("parallel.dp=2", "parallel.zero=3")),
    "tp2": (2, ("parallel.dp=1", "parallel.tp=2", "model.vocab_multiple=64")),
    "pp2": (2, ("parallel.dp=1", "parallel.pp=2")),
    "dp2xtp2": (4, ("parallel.dp=2", "parallel.tp=2", "model.vocab_multiple=64")),
    "pp2-zero3": (4, ("parallel.dp=2", "parallel.pp=2", "parallel.zero=3", "parallel.microbatches=2")),
    "zero2": (2, ("parallel.dp=2", "parallel.zero=2")),
    "cp2-zero3": (2, ("parallel.dp=1", "parallel.cp=2", "parallel.zero=3")),
    "ep2": (2, ("parallel.dp=2", "parallel.ep=2", "model.moe_experts=4")),
    "pp2xtp2": (4, ("parallel.dp=1", "parallel.pp=2", "parallel.tp=2", "model.vocab_multiple=64")),
}


@pytest.mark.parametrize("name", list(SHARDED))
def test_disk_offload_of_sharded_and_staged_parameters_is_the_same_adamw(pool2, pool4, tiny_text, tmp_path, name):
    """Each rank's state is its own shard's (a DTensor over the file's pieces, placed as its parameter): the run with
    the state on disk is the run without, step for step, and its checkpoint resumes onto the same weights."""
    world, layout = SHARDED[name]
    pool = pool4 if world == 4 else pool2
    base = ("train.steps=4", "checkpoint.every=2", *layout)
    ref = pool.run(rank0_params, tiny_gpt_config(tiny_text, *base), tmp_path / "none")[0]
    run = tmp_path / "disk"
    pool.run(rank0_params, tiny_gpt_config(tiny_text, *base, "parallel.offload='disk'", "train.stop_after=2"), run)
    got = pool.run(rank0_params, tiny_gpt_config(tiny_text, *base, "parallel.offload='disk'"), run, True)[0]
    assert max_diff(ref, got) <= 1e-6
    assert losses(run) == pytest.approx(losses(tmp_path / "none"), abs=1e-6)
    per_rank = json.loads((run / "summary.json").read_text())["memory"]["per_rank"]
    assert all(m["optimizer_bytes"] == 0 and m["optimizer_offloaded_bytes"] > 0 for m in per_rank)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.offload='disk'", "parallel.sync='gossip'"],
     "parallel.offload = 'disk' wraps the optimizer of an all-reduce layout; this one has sync = 'gossip', "
     "embedding_sharding = 'none': set parallel.offload='none'"),
    (["parallel.offload='disk'", "optim.name='lamb'"],
     "parallel.offload = 'disk' updates the optimizer state chunk by chunk, which needs an elementwise optimizer; "
     "optim.name = 'lamb' is not one: use one of adamw, sgd or set parallel.offload='none'"),
])
def test_bad_offload_configs(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_job(None, overrides)
    assert str(e.value) == message
