"""Expert parallel (plait.parallel.expert) against one process.

* The MoE layer with its experts on 2 ranks (uneven all-to-alls) against the single-process layer on
  the whole batch: outputs, input gradients, router gradient (summed over ranks, as data parallel's
  sum before its average), every expert's gradient on the rank that holds it, the routing counts and
  the all-to-all bytes against their arithmetic.
* Whole runs (plain SGD, no clipping; see test_equivalence.py for why): ep = 2 on dp = 2 and on
  dp = 4 (two replicas of each expert: the scale of their average), with ZeRO-3 and activation
  checkpointing, and with a finite capacity and another micro-batch size (capacity is per sequence),
  against one process on per-step loss, gradient norm and final weights; the metrics' expert load,
  the summary's memory per rank (expert parameters divided by ep) and the planner's figure for it.
* A run that goes ep = 2 -> ep = 1 -> ep = 2 through its checkpoints (SGD with momentum, so optimizer
  state reshards too) ends on the straight run's weights; checkpoints hold the plain model's names.
* Bad configs exit 2 before any worker starts, naming the keys.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from test_equivalence import GPT, SGD, assert_same_trajectory, errors, trajectory
from torch.distributed.device_mesh import init_device_mesh

from helpers import TINY_GPT, max_diff, params_after, rank0_params
from plait.cli import main
from plait.config import load_config
from plait.models.moe import A2A_BYTES, EXPERT_PARAMS, TAIL, MoE
from plait.parallel.expert import shard_experts
from plait.parallel.layout import Layout
from plait.plan.memory import Shape
from plait.report import write_report

WIDTH, HIDDEN, E = 6, 10, 4
MOE = ("model.moe_experts=4", "model.moe_top_k=2", "model.moe_aux_weight=0.01")


def layer_check(top_k: int, capacity_factor: float) -> dict:
    """Pool task (2 ranks): the layer with 2 experts per rank vs the whole layer on the whole batch."""
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = MoE(WIDTH, HIDDEN, E, top_k, capacity_factor)
    with torch.no_grad():
        ref.router.weight.normal_(0, 1.0)
        ref.b1.normal_(0, 0.1)
        ref.b2.normal_(0, 0.1)
    m = copy.deepcopy(ref)
    shard_experts(m, init_device_mesh("cpu", (1, n), mesh_dim_names=("ep_replica", "ep")))
    g = torch.Generator().manual_seed(1)
    x, up = torch.randn(4, 9, WIDTH, generator=g), torch.randn(4, 9, WIDTH, generator=g)
    rows = slice(rank * 4 // n, (rank + 1) * 4 // n)

    mine = x[rows].clone().requires_grad_()
    out = m(mine)
    (out * up[rows]).sum().backward()
    whole = x.clone().requires_grad_()
    want = ref(whole)
    (want * up).sum().backward()

    router = m.router.weight.grad.clone()
    dist.all_reduce(router)  # data parallel would sum (then average) the router's gradient over ranks
    local = E // n
    experts = {name: float((getattr(m, name).grad.to_local() - getattr(ref, name).grad[rank * local:(rank + 1) * local])
                           .abs().max()) for name in ("w1", "b1", "w2", "b2")}
    counts = m.stats[:E].clone()
    dist.all_reduce(counts)
    # Bytes: forward sends the rows routed to the other rank's experts and returns the rows it received; backward
    # sends the gradients of both back. The kept assignments of every rank, from the reference's routing:
    _, top_i, _, keep = ref.route(x.reshape(-1, WIDTH), 9)
    kept_expert = top_i if keep is None else top_i.masked_fill(~keep, -1)
    owner = kept_expert.view(4, 9, top_k) // local
    mine_to_other = int(((owner[rows] != rank) & (kept_expert.view(4, 9, top_k)[rows] >= 0)).sum())
    other = [i for i in range(4) if not rows.start <= i < rows.stop]
    other_to_mine = int((owner[other] == rank).sum())
    want_bytes = 2 * (mine_to_other + other_to_mine) * WIDTH * 4
    return {"out": float((out - want[rows]).abs().max()), "x_grad": float((mine.grad - whole.grad[rows]).abs().max()),
            "router": float((router - ref.router.weight.grad).abs().max()), **experts,
            "counts": float((counts - ref.stats[:E]).abs().max()), "dropped": float(ref.stats[E]),
            "bytes": float(m.stats[-TAIL + A2A_BYTES]), "want_bytes": want_bytes}


@pytest.mark.parametrize("top_k, cf", [(2, 0.0), (1, 0.5)], ids=["top2-dropless", "top1-capacity"])
def test_layer_on_two_ranks_matches_the_single_process_layer(pool2, top_k, cf):
    for rank, r in enumerate(pool2.run(layer_check, top_k, cf)):
        worst = max(r[k] for k in ("out", "x_grad", "router", "w1", "b1", "w2", "b2", "counts"))
        assert worst <= 1e-6, (rank, r)
        assert r["bytes"] == r["want_bytes"] > 0, (rank, r)
        assert (r["dropped"] > 0) == (cf > 0), r


# ---- whole runs against one process

def moe_run(cfg, run_dir):
    """Pool task: train; rank 0's trajectory, summary and metrics (None on other ranks)."""
    traj = trajectory(cfg, run_dir)
    if traj is None:
        return None
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return traj, json.loads((run_dir / "summary.json").read_text()), [r for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def moe_base(tiny_text):
    return (*TINY_GPT, *GPT, f"data.path='{tiny_text}'", *SGD, *MOE)


@pytest.fixture(scope="module")
def one_process(moe_base, tmp_path_factory):
    cache: dict = {}

    def get(*more: str):
        if more not in cache:
            run = tmp_path_factory.mktemp("moe-reference") / "run"
            cache[more] = moe_run(load_config(None, [*moe_base, "parallel.dp=1", *more]), run)
        return cache[more]

    return get


LAYOUTS = {
    "dp2-ep2": ("pool2", ("parallel.dp=2", "parallel.ep=2"), ()),
    "dp4-ep2": ("pool4", ("parallel.dp=4", "parallel.ep=2"), ()),  # each expert on 2 replicas
    "dp2-ep2-zero3-ckpt": ("pool2", ("parallel.dp=2", "parallel.ep=2", "parallel.zero=3",
                                     "train.activation_checkpointing=true"), ()),
    # capacity per sequence: micro-batches of 1 on 2 ranks drop what micro-batches of 2 in one process drop
    "dp2-ep2-capacity": ("pool2", ("parallel.dp=2", "parallel.ep=2", "train.micro_batch_size=1"),
                         ("model.moe_capacity_factor=1.0",)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_follows_one_process(request, one_process, moe_base, tmp_path, name):
    pool_name, layout, model = LAYOUTS[name]
    ref_traj, _, ref_rows = one_process(*model)
    got_traj, summary, rows = request.getfixturevalue(pool_name).run(
        moe_run, load_config(None, [*moe_base, *model, *layout]), tmp_path)[0]
    assert_same_trajectory(ref_traj, got_traj)
    e = errors(ref_traj, got_traj)
    print(f"{name}: loss {e['loss']:.1e} grad_norm {e['grad_norm']:.1e} weights {e['weights']:.1e}")
    # The expert load is layout-independent too (the same tokens go to the same experts).
    for ref, got in zip(ref_rows, rows, strict=True):
        assert ref["moe_tokens_per_expert"] == got["moe_tokens_per_expert"] and ref["moe_dropped"] == got["moe_dropped"]
        assert abs(ref["moe_aux_loss"] - got["moe_aux_loss"]) <= 1e-5 * ref["moe_aux_loss"]
        assert got["moe_a2a_bytes"] > 0 and "moe_a2a_bytes" not in ref
    tokens = 8 * 32 * 2  # global batch x context x top_k: every assignment, dropless
    if not model:
        assert all(sum(layer) == tokens for r in rows for layer in r["moe_tokens_per_expert"])
    else:
        assert all(r["moe_dropped"] > 0 for r in rows[1:])
    assert summary["parallel"]["strategy"].startswith("ep2+")
    if name == "dp2-ep2":
        check_memory(summary, moe_base)
        page = write_report(tmp_path).read_text()  # the report plots the expert load over the steps
        assert 'src="expert_load.png"' in page and (tmp_path / "expert_load.png").stat().st_size > 10_000


@pytest.mark.parametrize("pool_name, layout", [("pool2", ("parallel.dp=1", "parallel.tp=2")),
                                                ("pool4", ("parallel.dp=2", "parallel.tp=2"))], ids=["tp2", "dp2-tp2"])
def test_moe_blocks_stay_whole_under_tensor_parallel(request, one_process, moe_base, tmp_path, pool_name, layout):
    """tp splits attention and the dense MLPs; every tp rank routes the same whole activations through whole experts."""
    ref_traj, _, ref_rows = one_process()
    got_traj, summary, rows = request.getfixturevalue(pool_name).run(
        moe_run, load_config(None, [*moe_base, *layout]), tmp_path)[0]
    assert_same_trajectory(ref_traj, got_traj)
    for ref, got in zip(ref_rows, rows, strict=True):
        assert ref["moe_tokens_per_expert"] == got["moe_tokens_per_expert"]
    assert "tp2" in summary["parallel"]["strategy"] or summary["parallel"]["tp"] == 2


@pytest.mark.parametrize("pool_name, layout", [
    ("pool2", ("parallel.dp=1", "parallel.pp=2")),
    ("pool2", ("parallel.dp=1", "parallel.pp=2", "parallel.pp_schedule=gpipe", "train.activation_checkpointing=true")),
    ("pool4", ("parallel.dp=2", "parallel.pp=2", "parallel.zero=3")),
    ("pool4", ("parallel.dp=1", "parallel.pp=2", "parallel.tp=2")),
], ids=["pp2", "pp2-gpipe-ckpt", "pp2-zero3", "pp2-tp2"])
def test_moe_blocks_in_pipeline_stages(request, one_process, moe_base, tmp_path, pool_name, layout):
    """A stage that is not the last has no loss: each MoE layer injects its load-balancing loss's gradient at its
    output (the schedule scales it by the micro-batches as it scales the loss's), and the logged loss adds every
    stage's terms, so pp2 (1F1B, GPipe with recomputation), pp2 + ZeRO-3 and pp2 x tp2 are the one-process run."""
    ref_traj, _, _ = one_process()
    got_traj, summary, _ = request.getfixturevalue(pool_name).run(
        moe_run, load_config(None, [*moe_base, *layout]), tmp_path)[0]
    assert_same_trajectory(ref_traj, got_traj)
    assert summary["parallel"]["pp"] == 2


def check_memory(summary: dict, base) -> None:
    """Each rank holds the dense parameters and half the experts: params_bytes to the byte, and the planner agrees."""
    cfg = load_config(None, [*base, "parallel.dp=2", "parallel.ep=2"])
    shape = Shape.from_config(cfg.model, 160)
    model = shape.stage_params["model"]
    expert = sum(p.numel() for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] in EXPERT_PARAMS)
    dense = sum(p.numel() for p in model.parameters()) - expert
    assert expert == 4 * 4 * (32 * 128 * 2 + 128 + 32) and summary["params"] == dense + expert
    for rank in summary["memory"]["per_rank"]:
        assert rank["params_bytes"] == 4 * (dense + expert // 2)
    assert shape.device_params(Layout(dp=2, ep=2)) == [dense + expert // 2]


# ---- checkpoints reshard between ep = 2 and ep = 1

def test_resume_ep2_to_ep1_and_back(pool2, moe_base, tmp_path):
    momentum = ("optim.momentum=0.9", "train.steps=6", "log.every=1")
    cfg = lambda *more: load_config(None, [*moe_base, *momentum, *more])  # noqa: E731
    straight = params_after(cfg("parallel.dp=1"), None)
    run = tmp_path / "run"
    pool2.run(rank0_params, cfg("parallel.dp=2", "parallel.ep=2", "train.stop_after=2"), run)
    meta = dcp.FileSystemReader(str(run / "checkpoints" / "step_0000002")).read_metadata().state_dict_metadata
    assert list(meta["model.blocks.1.mlp.w1"].size) == [4, 32, 128]  # the whole layer, the single-process name
    assert "optim.state.blocks.1.mlp.w1.momentum_buffer" in meta
    pool2.run(rank0_params, cfg("parallel.dp=2", "parallel.ep=1", "train.stop_after=4"), run, True)
    final = pool2.run(rank0_params, cfg("parallel.dp=2", "parallel.ep=2"), run, True)[0]
    assert max_diff(straight, final) <= 1e-5


# ---- bad configs: exit 2 before any worker starts

@pytest.mark.parametrize("overrides, message", [
    (("model.moe_experts=4", "parallel.ep=3"), "parallel.ep = 3 must divide parallel.dp = 2"),
    (("model.moe_experts=3", "parallel.ep=2"), "parallel.ep = 2 must divide model.moe_experts = 3"),
    (("model.moe_experts=4", "model.moe_top_k=5"), "model.moe_top_k = 5 must be between 1 and model.moe_experts = 4"),
    (("model.moe_experts=4", "parallel.pp=2", "parallel.ep=2"), "parallel.ep = 2 with parallel.pp = 2: expert "
                                                                  "parallel's all-to-alls do not run inside pipeline"),
    (("model.moe_experts=4", "parallel.dp=1", "parallel.tp=2", "parallel.sequence_parallel=true"),
     "model.moe_experts (4) with parallel.sequence_parallel = true: an MoE block routes whole sequences"),
    (("parallel.ep=2",), "parallel.ep = 2 spreads mixture-of-experts layers over ranks, but the model has none"),
    (("model.moe_experts=4", "parallel.ep=2", "parallel.zero=1"), "parallel.zero = 1 with parallel.ep = 2"),
    (("model.moe_experts=4", "parallel.ep=0"), "parallel.ep = 0 must be >= 1"),
], ids=["ep-dp", "ep-experts", "top-k", "pipeline", "sequence-parallel", "no-moe", "zero1", "ep0"])
def test_bad_expert_configs_exit_2_before_any_worker_starts(tmp_path, monkeypatch, capsys, overrides, message):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    assert main(["train", *[a for o in overrides for a in ("--set", o)], "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    assert not out.exists()
