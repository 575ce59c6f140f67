"""DeepFM (Deep Learning at Scale ch. 9, exercises 3, 5, 6) at every layout: pipeline stages that pass two tensors
(the MLP's activations and the FM logit), tensor parallel over the MLP and the FM's latent dimensions, and both with
the embedding tables row-sharded over dp; each against one process under plain SGD."""

from __future__ import annotations

import pytest

from helpers import PLAIN_SGD, params_after, step_losses
from plait.config import load_config

STEPS = 4
DEEPFM = ["model.name='deepfm'", "data.name='clicks'", "model.width=32", "model.embedding_dim=4", "model.depth=2",
          "data.synthetic_samples=2000", "data.clicks_cardinalities=[3, 17, 50, 400]", "train.global_batch_size=32",
          "train.micro_batch_size=8", "train.eval_samples=200", "train.eval_batch_size=50", "log.progress=false",
          "log.report=false", "log.every=1", f"train.steps={STEPS}", *PLAIN_SGD, "optim.lr=0.3"]


def run(cfg, run_dir):
    """Pool task: (final weights, per-step (loss, grad norm), summary) on rank 0, and what every rank holds:
    {parameter name: elements held here}."""
    import torch.distributed as dist

    from plait.train.trainer import train

    r = train(cfg, run_dir)
    weights = r.strategy.full_model_state_dict()
    held = {n: (p.to_local() if hasattr(p, "to_local") else p).numel() for n, p in r.strategy.module.named_parameters()}
    return (weights, step_losses(run_dir), r.summary, held) if dist.get_rank() == 0 else held


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    d = tmp_path_factory.mktemp("one")
    weights = params_after(load_config(None, [*DEEPFM, "parallel.dp=1"]), d)
    return weights, step_losses(d)


def check(one, got, rel=2e-5, atol=1e-5):
    weights, losses = one
    params, mine = got[:2]
    assert len(mine) == len(losses) == STEPS
    for (l1, g1), (l2, g2) in zip(losses, mine):
        assert l2 == pytest.approx(l1, rel=rel) and g2 == pytest.approx(g1, rel=rel)
    assert params.keys() == weights.keys()
    assert max((weights[k] - params[k]).abs().max().item() for k in weights) < atol


TWO = {
    "pp2-1f1b": ("parallel.pp=2", "parallel.pp_schedule='1f1b'"),
    "pp2-gpipe": ("parallel.pp=2", "parallel.pp_schedule='gpipe'"),
    "tp2": ("parallel.tp=2",),
}


@pytest.mark.parametrize("name", list(TWO))
def test_two_rank_layouts(pool2, one, tmp_path, name):
    got, held1 = pool2.run(run, load_config(None, [*DEEPFM, "parallel.dp=1", *TWO[name]]), tmp_path)
    check(one, got)
    held0, total = got[3], {k: v.numel() for k, v in one[0].items()}
    if name.startswith("pp"):  # stage 0: tables, FM, first Linear; stage 1: the rest
        assert got[2]["pipeline"]["stage_blocks"] == [[0, 1], [1, 7]]  # balanced: the tables weigh most
        assert sorted(held0) == sorted(k for k in total if not k.startswith("mlp.") or k.startswith("mlp.0."))
        assert sorted(held1) == ["mlp.3.bias", "mlp.3.weight", "mlp.6.bias", "mlp.6.weight"]
    else:  # the MLP's first pair split over the two ranks (column-, then row-parallel), the rest whole on both
        assert held0 == held1 and held0.keys() == total.keys()
        split = {"mlp.0.weight", "mlp.0.bias", "mlp.3.weight"}
        assert {k: v for k, v in held0.items() if k not in split} == {k: v for k, v in total.items() if k not in split}
        assert all(held0[k] * 2 == total[k] for k in split)


FOUR = {
    "dp2xtp2-row": ("parallel.dp=2", "parallel.tp=2", "parallel.embedding_sharding='row'"),
    "dp2xtp2-table": ("parallel.dp=2", "parallel.tp=2", "parallel.embedding_sharding='table'"),
    "dp2xpp2": ("parallel.dp=2", "parallel.pp=2"),
    "pp2xtp2": ("parallel.dp=1", "parallel.pp=2", "parallel.tp=2"),
    "dp2xpp2-row": ("parallel.dp=2", "parallel.pp=2", "parallel.embedding_sharding='row'"),
    "dp2xpp2-table": ("parallel.dp=2", "parallel.pp=2", "parallel.embedding_sharding='table'"),
}


@pytest.mark.parametrize("name", list(FOUR))
def test_four_rank_layouts(pool4, one, tmp_path, name):
    got, *held = pool4.run(run, load_config(None, [*DEEPFM, *FOUR[name]]), tmp_path)
    check(one, got)
    held = [got[3], *held]
    tables = sum(v.numel() for k, v in one[0].items() if k.startswith("embed."))  # (3 + 17 + 50 + 400) rows x 5
    copies = 2 if "tp2" in name else 1  # the tp ranks of a dp rank hold the same rows; each dp rank its own share
    if name.endswith(("-row", "-table")):
        assert sum(v for h in held for k, v in h.items() if k.startswith("embed.")) == tables * copies


@pytest.mark.slow
def test_dp2_pp2_tp2_with_row_sharded_tables_on_8_processes(one, tmp_path):
    """Exercise 6, all at once: tables row-sharded over dp on the first stage, the MLP and FM split over tp."""
    cfg = load_config(None, [*DEEPFM, "parallel.dp=2", "parallel.pp=2", "parallel.tp=2",
                             "parallel.embedding_sharding='row'"])
    check(one, fresh(8, cfg, tmp_path)[0])


def fresh(world: int, cfg, run_dir) -> list:
    """run() on ranks of their own, forked from a server that imported the trainer once (torch's RPC starts once in
    a process: an RPC pipeline cannot run in the pool's ranks after another)."""
    from plait.testing import run_distributed

    return run_distributed(run, world, cfg, run_dir, timeout_s=240)


def test_rpc_pipeline_exercise_4(one, tmp_path):
    """Exercise 4: the stages as RemoteModules, activations and gradients by RPC, backward through distributed
    autograd; the same trajectory, each stage's parameters on its own rank."""
    cfg = load_config(None, [*DEEPFM, "parallel.dp=1", "parallel.pp=2", "parallel.pp_schedule='gpipe'",
                             "parallel.pp_transport='rpc'"])
    got, held1 = fresh(2, cfg, tmp_path)
    check(one, got)
    assert got[2]["pipeline"]["transport"] == "rpc" and got[2]["pipeline"]["stage_blocks"] == [[0, 1], [1, 7]]
    assert sorted(held1) == ["mlp.3.bias", "mlp.3.weight", "mlp.6.bias", "mlp.6.weight"]


def test_a_dead_rpc_stage_is_an_error_naming_it(tmp_path, monkeypatch):
    """Stage 1's process is killed as step 2 begins: the driver's RPC fails at once and its error names the stage,
    instead of waiting for it."""
    from plait.testing import DistributedError

    cfg = load_config(None, [*DEEPFM, "parallel.dp=1", "parallel.pp=2", "parallel.pp_schedule='gpipe'",
                             "parallel.pp_transport='rpc'", "train.steps=50"])
    monkeypatch.setenv("PLAIT_FAULTS", "kill:rank=1:step=2")
    with pytest.raises(DistributedError) as err:
        fresh(2, cfg, tmp_path)
    assert "StageLost: pipeline stage 1 (pipeline rank 1, global rank 1) stopped answering" in str(err.value)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.dp=2", "parallel.pp=2", "parallel.pp_schedule='gpipe'"],
     "parallel.pp_transport = 'rpc' runs one plain stage per process (pp only, fp32 or bf16); it does not combine "
     "with parallel.dp = 2: drop them or set pp_transport = 'collective'"),
    (["parallel.dp=1", "parallel.pp=2"],
     "parallel.pp_transport = 'rpc' runs GPipe's schedule (every micro-batch forward, then one backward through "
     "distributed autograd); set parallel.pp_schedule='gpipe' (it is '1f1b')"),
    (["parallel.dp=1"], "parallel.pp_transport = 'rpc' runs pipeline stages over RPC: set parallel.pp >= 2"),
])
def test_bad_rpc_pipeline_configs(overrides, message):
    from plait.errors import ConfigError
    from plait.train.job import load_job

    with pytest.raises(ConfigError) as err:
        load_job(None, [*DEEPFM, "parallel.pp_transport='rpc'", *overrides])
    assert str(err.value) == message
