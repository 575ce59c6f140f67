"""Shard-only initialisation: ZeRO-3 ranks build the model on the meta device and materialise only their shards.

The values are a single process's (layout independence from step 0), and no rank ever holds the whole model.
"""

import pytest
import torch
import torch.nn as nn

from helpers import max_diff, params_after, tiny_gpt_config
from plait.data import build_data
from plait.models import build_model
from plait.models.meta import build_on_meta, materialize

# plain SGD: a wrong gradient scale cannot hide behind Adam; lr = 0 leaves the first step's weights at the init
SGD = ("optim.name='sgd'", "optim.momentum=0", "optim.warmup_steps=0", "optim.schedule='constant'",
       "checkpoint.every=0")


def cfg(corpus, dp, *more):
    return tiny_gpt_config(corpus, f"parallel.dp={dp}", f"parallel.zero={3 if dp > 1 else 0}", "model.layers=4",
                           f"train.micro_batch_size={8 // dp}", *SGD, *more)


def zero3_run(cfg, run_dir):
    """Pool task: train; rank 0 returns (the whole model's parameters, every rank's materialisation figures)."""
    import torch.distributed as dist

    from plait.train.trainer import train

    result = train(cfg, run_dir)
    params = result.strategy.full_model_state_dict()
    figures = [None] * dist.get_world_size()
    dist.all_gather_object(figures, getattr(result.strategy, "init_memory", None))
    return (params, figures) if dist.get_rank() == 0 else None


def zero3_init(cfg):
    """Pool task: build on meta, shard with FSDP2 (ZeRO-3) and materialise as plait train does; rank 0 returns the
    gathered step-0 parameters and every rank's materialisation figures."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from plait.parallel.fsdp import apply_fsdp
    from plait.runtime import seed_all
    from plait.train.job import check_job

    rt = check_job(cfg).init_runtime(cfg.launch)
    spec = build_data(cfg.data, cfg.model).spec
    seed_all(cfg.train.seed)
    module, record = build_on_meta(lambda: build_model(cfg.model, spec))
    module = apply_fsdp(module, rt.mesh["dp"], 3)
    figures = [None] * dist.get_world_size()
    dist.all_gather_object(figures, materialize(module, record, rt.device))
    params = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    return ({k: v.detach().clone() for k, v in params.items()}, figures) if dist.get_rank() == 0 else None


def single_process_init(c) -> nn.Module:
    from plait.runtime import seed_all

    seed_all(c.train.seed)
    return build_model(c.model, build_data(c.data, c.model).spec)


def test_zero3_ranks_start_from_the_single_process_init_without_holding_the_model(pool2, tiny_text, tmp_path):
    c = cfg(tiny_text, 2)
    got, figures = pool2.run(zero3_init, c)[0]
    plain = single_process_init(c)
    assert max_diff(plain.state_dict(), got) == 0.0  # exactly, not within a tolerance
    full = figures[0]["full_bytes"]
    assert full == 4 * sum(p.numel() for p in plain.parameters())  # fp32, tied weights once
    budget = 0.75 * full  # per rank: its half of the shards plus one whole parameter at a time stays under it
    for rank, f in enumerate(figures):
        assert f["full_bytes"] == full > budget
        assert f["peak_bytes"] <= budget, (rank, f)
        assert f["local_bytes"] == pytest.approx(full / 2, rel=0.05), (rank, f)


def test_zero3_with_shard_init_follows_one_process_with_plain_sgd(pool2, tiny_text, tmp_path):
    more = ("train.steps=3", "optim.lr=0.1")
    ref = params_after(cfg(tiny_text, 1, *more), None)
    got, figures = pool2.run(zero3_run, cfg(tiny_text, 2, *more), tmp_path / "z3")[0]
    assert all(f is not None for f in figures)  # the shard-only path ran
    assert max_diff(ref, got) <= 1e-5


@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_replay_gives_the_plain_build_and_leaves_the_generator_where_it_would(model):
    from plait.config import load_config

    data = "digits" if model == "mlp" else "stdlib-text"
    c = load_config(None, [f"model.name='{model}'", f"data.name='{data}'", "model.layers=2", "model.width=32",
                           "model.heads=2", "model.context=16"])
    spec = build_data(c.data, c.model).spec
    torch.manual_seed(3)
    plain = build_model(c.model, spec)
    after = torch.get_rng_state()
    torch.manual_seed(3)
    before = torch.get_rng_state()
    module, record = build_on_meta(lambda: build_model(c.model, spec))
    assert record.supported and torch.equal(torch.get_rng_state(), before)  # the meta build drew nothing
    figures = materialize(module, record, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), after)
    assert max_diff(plain.state_dict(), module.state_dict()) == 0.0
    if model == "gpt":  # tied embedding and head stay one parameter
        assert module.head.weight is module.tok_emb.weight
    assert figures["local_bytes"] == figures["full_bytes"] == 4 * sum(p.numel() for p in plain.parameters())


class Truncated(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        nn.init.trunc_normal_(self.a.weight, std=0.02)


class Copied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.b.weight.data.copy_(self.a.weight)


class Loaded(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.a.load_state_dict({"weight": torch.ones(3, 3, device="cpu"), "bias": torch.zeros(3, device="cpu")},
                               assign=True)


@pytest.mark.parametrize("model, reason", [
    (Truncated, "torch.nn.init.trunc_normal_ cannot be replayed (its values depend on data)"),
    (Copied, "aten.copy_.default writes a tensor from another tensor"),
    (Loaded, "parameters off the meta device (a.weight, a.bias), e.g. loaded weights"),
])
def test_data_dependent_initialisation_is_refused_with_the_reason(model, reason):
    _, record = build_on_meta(model)
    assert not record.supported and record.unsupported == reason
