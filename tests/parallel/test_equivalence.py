"""Layout independence with plain SGD: every layout follows the single process's trajectory, step by step.

plait's contract: dp / tp / pp / zero / micro-batch size change speed and memory, never the trajectory
beyond float reduction order. The optimizer here is SGD without momentum, weight decay, clipping or a
schedule, so an update is exactly -lr * gradient: a gradient that is off by a constant factor (averaged
over ranks twice, or not at all) changes the weights from the first step and the logged gradient norm
at once. AdamW (invariant to the gradient's scale) and clipping (which rescales it to a fixed norm)
would both hide that, which is why the layouts are not compared under them.

Each layout is compared with one process on the same config: the loss and gradient norm of every step
(RUN_DIR/metrics.jsonl, logged on every step) and the final weights.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from helpers import TINY_GPT, finish_ranks, params_after, start_ranks
from plait.config import dump_config, load_config
from plait.testing import run_distributed

STEPS = 4
# lr 0.3: halving the gradient (a dp average taken twice) then moves the step-2 loss by 5 %, the step-1 gradient
# norm by 50 % and the weights by 0.06, four orders of magnitude above the tolerances below; and the loss still
# falls steadily (at 0.5 and 1.0 it jumps, 4.1 -> 4.7 and 4.5 -> 6.4, which would amplify rounding differences).
SGD = ("optim.name='sgd'", "optim.lr=0.3", "optim.momentum=0", "optim.weight_decay=0", "optim.grad_clip=0",
       "optim.schedule='constant'", "optim.warmup_steps=0", "log.every=1", f"train.steps={STEPS}", "checkpoint.every=0")
# The tiny corpus has 159 characters and tensor parallel splits the vocabulary: round it up. 4 layers so that
# interleaved 1F1B has 2 stages per rank; micro-batches of 2 of a global batch of 8 accumulate 4 in one
# process, 2 per rank at dp = 2 (and the pipeline's micro-batches are these).
GPT = ("data.name='text'", "model.vocab_size=160", "model.layers=4", "train.global_batch_size=8",
       "train.micro_batch_size=2")
DEEPFM = ("model.name='deepfm'", "data.name='clicks'", "model.width=32", "model.embedding_dim=4",
          "data.synthetic_samples=2000", "data.clicks_cardinalities=[3, 17, 50, 400]", "train.global_batch_size=32",
          "train.micro_batch_size=8", "train.eval_samples=200", "train.eval_batch_size=50", "log.progress=false",
          "log.report=false")
MLP = ("model.name='mlp'", "data.name='digits'", "model.width=64", "train.global_batch_size=64",
       "train.micro_batch_size=16", "train.sample_tokens=0", "log.progress=false", "log.report=false",
       "train.eval_samples=400", "train.eval_batch_size=50")

# Float32 throughout: the layouts add the same numbers in other orders (a tensor-parallel matmul splits its inner
# dimension, the data-parallel all-reduce adds two halves of the batch, ...), a few ulps (1e-7 relative) per
# operation. Measured over these 4 steps, all layouts: loss <= 1.7e-7 relative, gradient norm <= 2.1e-7 relative,
# weights <= 1.2e-7 absolute. 1e-5 leaves a margin of 50; a 2x gradient error is 5e-2 to 5e-1.
RTOL = ATOL = 1e-5


@dataclass
class Trajectory:
    loss: list[float]
    grad_norm: list[float]
    params: dict[str, torch.Tensor]


def read_trajectory(run_dir: Path, params: dict) -> Trajectory:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "loss" in r]
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))
    return Trajectory([r["loss"] for r in logged], [r["grad_norm"] for r in logged], params)


def trajectory(cfg, run_dir: Path) -> Trajectory | None:
    """Pool task (or in-process): train; rank 0's logged trajectory and final weights (None on other ranks)."""
    import torch.distributed as dist

    params = params_after(cfg, run_dir)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    return read_trajectory(run_dir, params)


def errors(ref: Trajectory, got: Trajectory) -> dict[str, float]:
    """Worst relative error of the per-step loss and gradient norm, and worst weight difference (absolute)."""
    def rel(a: list[float], b: list[float]) -> float:
        return max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True))

    assert ref.params.keys() == got.params.keys()
    return {"loss": rel(ref.loss, got.loss), "grad_norm": rel(ref.grad_norm, got.grad_norm),
            "weights": max(float((ref.params[k] - got.params[k]).abs().max()) for k in ref.params)}


def assert_same_trajectory(ref: Trajectory, got: Trajectory) -> None:
    assert all(math.isfinite(x) for x in got.loss + got.grad_norm)
    e = errors(ref, got)
    detail = f"errors {e}; loss {ref.loss} vs {got.loss}; grad_norm {ref.grad_norm} vs {got.grad_norm}"
    assert e["loss"] <= RTOL and e["grad_norm"] <= RTOL and e["weights"] <= ATOL, detail


@pytest.fixture(scope="module")
def base(tiny_text):
    """The overrides of each model family (the corpus path is only known at run time)."""
    return {"gpt": (*TINY_GPT, *GPT, f"data.path='{tiny_text}'"), "deepfm": DEEPFM, "mlp": MLP}


@pytest.fixture(scope="module")
def reference(base, tmp_path_factory):
    """reference(family, *overrides): the single-process trajectory of a config, computed once per module."""
    cache: dict[tuple, Trajectory] = {}

    def get(family: str, *more: str) -> Trajectory:
        key = (family, *more)
        if key not in cache:
            run = tmp_path_factory.mktemp("reference") / "run"
            cache[key] = trajectory(load_config(None, [*base[family], *SGD, "parallel.dp=1", *more]), run)
        return cache[key]

    return get


def test_the_reference_trains_and_a_2x_gradient_error_shows(reference):
    """The tolerances are meaningful: SGD at this lr moves the loss, and half the gradient is far outside them."""
    ref = reference("gpt")
    assert ref.loss[-1] < ref.loss[0] - 0.5
    half = reference("gpt", "optim.lr=0.15")  # lr / 2 = the update of a gradient averaged twice over dp = 2
    e = errors(ref, half)
    assert e["loss"] > 1000 * RTOL and e["grad_norm"] > 1000 * RTOL and e["weights"] > 1000 * ATOL, e


# One process, another split of the same global batch: the micro-batch loss scale alone.
@pytest.mark.parametrize("overrides", [
    ("train.micro_batch_size=8",),  # no accumulation (the reference accumulates 4)
    ("train.micro_batch_size=2", "train.activation_checkpointing=true"),
], ids=["micro8", "activation-checkpointing"])
def test_one_process_variants(reference, base, tmp_path, overrides):
    got = trajectory(load_config(None, [*base["gpt"], *SGD, "parallel.dp=1", *overrides]), tmp_path)
    assert_same_trajectory(reference("gpt"), got)


TWO = {
    "dp2": ("parallel.dp=2",),
    "dp2-zero1": ("parallel.dp=2", "parallel.zero=1"),
    "dp2-zero2": ("parallel.dp=2", "parallel.zero=2"),
    "dp2-zero3": ("parallel.dp=2", "parallel.zero=3"),
    "dp2-zero3-micro4": ("parallel.dp=2", "parallel.zero=3", "train.micro_batch_size=4"),  # no accumulation
    # Activation checkpointing wraps the blocks before the ZeRO schemes see them (FSDP then wraps the wrappers).
    "dp2-zero1-ckpt": ("parallel.dp=2", "parallel.zero=1", "train.activation_checkpointing=true"),
    "dp2-zero2-ckpt": ("parallel.dp=2", "parallel.zero=2", "train.activation_checkpointing=true"),
    "dp2-zero3-ckpt": ("parallel.dp=2", "parallel.zero=3", "train.activation_checkpointing=true"),
    "tp2": ("parallel.dp=1", "parallel.tp=2"),
    "tp2-sp": ("parallel.dp=1", "parallel.tp=2", "parallel.sequence_parallel=true"),
    "pp2-gpipe": ("parallel.dp=1", "parallel.pp=2", "parallel.pp_schedule='gpipe'"),
    "pp2-1f1b": ("parallel.dp=1", "parallel.pp=2", "parallel.pp_schedule='1f1b'"),
    "pp2-interleaved": ("parallel.dp=1", "parallel.pp=2", "parallel.pp_schedule='interleaved-1f1b'",
                        "parallel.virtual_stages=2"),
}


@pytest.mark.parametrize("name", list(TWO))
def test_two_rank_layouts(pool2, reference, base, tmp_path, name):
    got = pool2.run(trajectory, load_config(None, [*base["gpt"], *SGD, *TWO[name]]), tmp_path)[0]
    assert_same_trajectory(reference("gpt"), got)


FOUR = {
    "dp2xtp2": ("parallel.dp=2", "parallel.tp=2"),
    "dp2xpp2": ("parallel.dp=2", "parallel.pp=2"),
    "pp2xtp2": ("parallel.dp=1", "parallel.pp=2", "parallel.tp=2"),
    "pp2xtp2-sp": ("parallel.dp=1", "parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true"),
    "dp2xtp2-zero3": ("parallel.dp=2", "parallel.tp=2", "parallel.zero=3"),
    # 4 shards, no accumulation (micro-batches of 2 = the local batch)
    "dp4-zero1": ("parallel.dp=4", "parallel.zero=1"),
    "dp4-zero2": ("parallel.dp=4", "parallel.zero=2"),
    "dp4-zero3": ("parallel.dp=4", "parallel.zero=3"),
}


@pytest.mark.parametrize("name", list(FOUR))
def test_four_rank_layouts(pool4, reference, base, tmp_path, name):
    got = pool4.run(trajectory, load_config(None, [*base["gpt"], *SGD, *FOUR[name]]), tmp_path)[0]
    assert_same_trajectory(reference("gpt"), got)


def resized(cfg, run_dir: Path):
    """Pool task: what an elastic job's restarted worker does after losing ranks (plait.launch.job.fit for the pool's
    world size), then resume; (the layout it chose, the trajectory) on rank 0."""
    import torch.distributed as dist

    from plait.launch.env import ClusterEnv
    from plait.launch.job import fit

    world, rank = dist.get_world_size(), dist.get_rank()
    env = ClusterEnv("torchrun", "process", world, rank, rank, world, 0, "1:2", "127.0.0.1", 0)
    new = fit(cfg, env)
    params = params_after(new, run_dir, resume=True)
    p = new.parallel
    return ((p.dp, p.tp, p.pp), read_trajectory(run_dir, params)) if rank == 0 else None


def test_a_tp_pp_job_that_loses_half_its_ranks_replans_and_keeps_the_trajectory(pool4, pool2, reference, base,
                                                                                  tmp_path):
    """launch.on_resize = 'replan': tp 2 x pp 2 on 4 ranks, then 2 ranks remain (tp x pp cannot divide them): the
    planner's layout of 2 ranks takes over from the checkpoint of step 2, and the 4 steps are one process's."""
    cfg = load_config(None, [*base["gpt"], *SGD, *FOUR["pp2xtp2"], "launch.on_resize='replan'",
                             "launch.max_restarts=1", "train.stop_after=2"])
    pool4.run(trajectory_part, cfg, tmp_path)
    cfg.train.stop_after = 0
    layout, got = pool2.run(resized, cfg, tmp_path)[0]
    assert layout[0] * layout[1] * layout[2] == 2 and layout != (1, 2, 2)
    assert_same_trajectory(reference("gpt"), got)


def trajectory_part(cfg, run_dir: Path) -> None:
    params_after(cfg, run_dir)


def test_untied_embeddings_under_pipeline_and_tensor_parallel(pool4, reference, base, tmp_path):
    # Tied, the embedding and the head are one weight whose two copies (first and last stage) sum their
    # gradients; untied they are two weights, each on its own stage.
    untied = "model.tie_embeddings=false"
    got = pool4.run(trajectory, load_config(None, [*base["gpt"], *SGD, "parallel.dp=1", "parallel.pp=2",
                                                   "parallel.tp=2", untied]), tmp_path)[0]
    assert_same_trajectory(reference("gpt", untied), got)


@pytest.mark.parametrize("layout", [
    ("model.name='deepfm'", "parallel.embedding_sharding='row'"),
    ("model.name='deepfm'", "parallel.embedding_sharding='table'"),
    ("model.name='mlp'",),
], ids=["deepfm-row", "deepfm-table", "mlp-dp2"])
def test_other_models_under_data_parallel(pool2, reference, base, tmp_path, layout):
    family = layout[0].split("'")[1]
    got = pool2.run(trajectory, load_config(None, [*base[family], *SGD, "parallel.dp=2", *layout[1:]]), tmp_path)[0]
    assert_same_trajectory(reference(family), got)


@pytest.mark.slow
def test_3d_dp2_pp2_tp2_on_8_processes(reference, base, tmp_path):
    """dp x pp x tp all at once: the mesh's three axes, the tied weight across stages and tp groups, dp sync.
    The 8 ranks are forked warm, as every rank of the suite is (tests/conftest.py: PLAIT_WARM_RANKS)."""
    cfg = load_config(None, [*base["gpt"], *SGD, "parallel.dp=2", "parallel.pp=2", "parallel.tp=2"])
    got = run_distributed(trajectory, 8, cfg, tmp_path, timeout_s=120)[0]
    assert_same_trajectory(reference("gpt"), got)


def test_rpc_pipeline(reference, base, tmp_path):
    """The stages' activations and gradients by RPC (RemoteModule, distributed autograd); the tied embedding's two
    copies summed as in the collective pipeline. Fresh ranks: torch's RPC starts once in a process."""
    cfg = load_config(None, [*base["gpt"], *SGD, "parallel.dp=1", "parallel.pp=2", "parallel.pp_schedule='gpipe'",
                             "parallel.pp_transport='rpc'"])
    got = run_distributed(trajectory, 2, cfg, tmp_path, timeout_s=120)[0]
    assert_same_trajectory(reference("gpt"), got)


def test_parameter_server_sync(reference, base, tmp_path):
    """dp = 2 workers and one server in sync mode. A PS job joins no process group (its ranks talk by RPC), so it cannot
    run in a RankPool: each rank is started as `python -m plait.worker RUN`, as tests/ps/test_ps.py does."""
    from safetensors.torch import load_file

    from plait.export import export

    cfg = load_config(None, [*base["gpt"], *SGD, "parallel.dp=2", "parallel.sync='ps'", "parallel.ps_servers=1",
                             "launch.timeout_s=60"])
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(dump_config(cfg))
    codes, outs = finish_ranks(start_ranks(run, 3), 120)
    assert codes == [0, 0, 0], outs
    got = read_trajectory(run, load_file(str(export(run))))
    assert_same_trajectory(reference("gpt"), got)
