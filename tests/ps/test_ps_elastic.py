"""Elastic parameter server: colocated servers (same trajectory as dedicated ones, (dp-1)/dp of the bytes), a worker
that joins mid-run starts from the servers' current parameters, and launch.nnodes = MIN:MAX where it is sound."""

import atexit
import json
from pathlib import Path

import pytest
import torch

from helpers import finish_ranks, max_diff, start_ranks
from plait.config import dump_config, load_config
from plait.errors import ConfigError
from plait.parallel import ps as ps_scheme
from plait.parallel.layout import Layout
from plait.ps.client import PSClient
from plait.ps.server import ParameterServer
from plait.train.job import load_job

STEPS = 12
SGD = ["model.name='mlp'", "data.name='digits'", f"train.steps={STEPS}", "train.micro_batch_size=16", "optim.name='sgd'",
       "optim.momentum=0.0", "optim.lr=2.0", "optim.warmup_steps=0", "optim.weight_decay=0.0", "log.progress=false",
       "log.report=false", "log.every=1", "train.eval_samples=64", "launch.timeout_s=60", "checkpoint.every=0",
       "parallel.sync='ps'", "parallel.dp=2"]
ELASTIC = ["launch.nnodes='1:2'", "launch.rdzv_endpoint='h:1'", "launch.nproc_per_node=2"]


def message(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_job(None, [*SGD, *overrides])
    return str(e.value)


# ---- launch.nnodes = MIN:MAX: the config decision


def test_an_async_or_ssp_ps_job_may_be_elastic():
    for mode in ("async", "ssp"):
        cfg = load_job(None, [*SGD, "parallel.dp=3", "train.global_batch_size=48", f"parallel.ps_mode='{mode}'", *ELASTIC])
        assert cfg.node_range == (1, 2) and Layout.from_config(cfg).world_size == 4  # 3 workers + 1 server on 2 x 2


def test_what_stays_refused_for_an_elastic_ps_job():
    assert message("parallel.dp=3", "train.global_batch_size=48", *ELASTIC) == (
        "parallel.sync = 'ps' with launch.nnodes = 1:2: parallel.ps_mode = 'sync' needs every worker at every step, and "
        "an elastic job goes on without some; set parallel.ps_mode = 'async' or 'ssp', or launch.nnodes to a fixed "
        "number of machines")
    assert message("parallel.ps_mode='async'", "parallel.ps_placement='colocated'", *ELASTIC,
                   "launch.nproc_per_node=1") == (
        "parallel.sync = 'ps' with launch.nnodes = 1:2: with parallel.ps_placement = 'colocated' a worker that leaves "
        "takes its shard of the parameters with it; set parallel.ps_placement = 'dedicated', or launch.nnodes to a "
        "fixed number of machines")
    # one machine of 2 processes, both servers: no worker left at the minimum size
    assert message("parallel.ps_mode='async'", "parallel.ps_servers=2", *ELASTIC) == (
        "parallel.sync = 'ps' with launch.nnodes = 1:2: at 1 machine(s) x 2 processes the 2 parameter server(s) leave "
        "no worker; set launch.nnodes to at least 2:2, or more processes per machine")
    # global batch 32 = 16 x 2 at full size; one machine leaves 1 worker (fine), but 3 workers do not divide 32 by 16
    assert message("parallel.ps_mode='async'", "parallel.dp=5", "parallel.ps_servers=1", "launch.nnodes='2:3'",
                   "launch.rdzv_endpoint='h:1'", "launch.nproc_per_node=2", "train.global_batch_size=80") == (
        "parallel.sync = 'ps' with launch.nnodes = 2:3: at 2 machine(s) the job has 3 workers, and "
        "train.global_batch_size (80) is not divisible by train.micro_batch_size (16) * 3; choose a micro batch size "
        "that divides the global batch at every size")


def test_an_elastic_ps_job_resized_keeps_its_servers():
    from plait.launch.job import fit_to_world

    cfg = load_job(None, [*SGD, "parallel.dp=3", "train.global_batch_size=48", "parallel.ps_mode='async'", *ELASTIC])
    small = fit_to_world(cfg, 2)  # one machine of two processes left: 1 worker + the server
    assert (small.parallel.dp, small.parallel.ps_servers, Layout.from_config(small).world_size) == (1, 1, 2)
    assert [Layout.from_config(small).role(r) for r in range(2)] == ["trainer", "server"]


# ---- colocated placement: layout and roles


def test_colocated_servers_add_no_process():
    cfg = load_config(None, [*SGD, "parallel.ps_placement='colocated'", "parallel.ps_servers=3"])
    layout = Layout.from_config(cfg)
    assert layout.world_size == 2 and [layout.role(r) for r in range(2)] == ["trainer", "worker"]
    load_job(None, [*SGD, "parallel.ps_placement='colocated'", "parallel.ps_servers=3"])  # ps_servers is not used


# ---- a worker that joins mid-run


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _sgd(module, only=None):
    return torch.optim.SGD([p for p in module.parameters() if only is None or id(p) in only], lr=0.1, momentum=0.9)


def test_a_worker_that_joins_mid_run_starts_from_the_servers_parameters():
    """Two servers (row blocks of every tensor, as colocated ones hold) advanced k = 5 asynchronous updates by worker
    0; worker 1 was dead. Its replacement, built with another init, takes exactly the servers' parameters before its
    first step and is not held back by SSP."""
    cfg = load_config(None, [*SGD, "parallel.ps_mode='ssp'", "parallel.staleness=1", "launch.timeout_s=5"])
    cut = ps_scheme.shards(_mlp(0), 2, rows=True)
    assert cut[1][0] == ("0.weight", 8, 16) and len(cut[0]) == len(cut[1]) == 4
    servers = {k: ParameterServer(k, _mlp(0), cut[k], cfg, _sgd) for k in range(2)}
    chief = PSClient(_mlp(0), 0, cut, local=servers)
    atexit.unregister(chief.finish)  # no RPC job to leave here
    chief.open()
    servers[0].dead.add(1), servers[1].dead.add(1)  # worker 1 died (its pings failed)
    x = torch.randn(32, 8)
    for _ in range(5):
        chief.module(x).square().mean().backward()
        chief.push_async(lr=0.1)
        chief.module.zero_grad(set_to_none=True)
    want, optim = chief.state()  # the servers' row blocks joined, by parameter name
    assert want.keys() == dict(_mlp(0).named_parameters()).keys() and optim["0.weight"]["momentum_buffer"].shape == (16, 8)
    assert max_diff(want, {n: p.detach() for n, p in _mlp(0).named_parameters()}) > 0.01  # the servers moved on

    late = PSClient(_mlp(1), 1, cut, local=servers)  # a replacement with another init
    atexit.unregister(late.finish)
    late.wait_open()
    got = {n: p.detach() for n, p in late.module.named_parameters()}
    assert all(torch.equal(got[n], want[n]) for n in want) and got.keys() == want.keys()
    assert late.versions == [5, 5] and all(s.dead == set() and s.clocks == [5, 5] for s in servers.values())
    late.module(x).square().mean().backward()
    assert late.push_async(lr=0.1) == [0, 0]  # computed on the current parameters: staleness 0, no SSP wait
    # A checkpoint's state (joined by name) loads back into the row blocks exactly (what a resume does).
    params, optim = chief.state()
    chief.load(want, optim)
    again, again_optim = chief.state()
    assert all(torch.equal(again[n], want[n]) for n in want) and not all(torch.equal(params[n], want[n]) for n in want)
    assert all(torch.equal(again_optim[n]["momentum_buffer"], optim[n]["momentum_buffer"]) for n in optim)


# ---- colocated vs dedicated servers: the same sync trajectory, (dp-1)/dp of the bytes


@pytest.fixture(scope="module")
def placements(tmp_path_factory) -> dict[str, Path]:
    """The same sync SGD job with one dedicated server (3 processes) and with colocated servers (2 processes), both at
    once, each rank started as `python -m plait.worker RUN` (what torchrun's agent starts, without the agents)."""
    root = tmp_path_factory.mktemp("placement")
    runs, procs = {}, []
    for name in ("dedicated", "colocated"):
        cfg = load_config(None, [*SGD, f"parallel.ps_placement='{name}'"])
        runs[name] = root / name
        runs[name].mkdir()
        (runs[name] / "config.toml").write_text(dump_config(cfg))
        procs += start_ranks(runs[name], Layout.from_config(cfg).world_size)
    codes, outs = finish_ranks(procs, 240)
    assert codes == [0] * 5, outs
    return runs


def _rows(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.slow  # ~25 s: two small jobs at once
def test_colocated_servers_follow_the_dedicated_trajectory_and_send_less(placements):
    from safetensors.torch import load_file

    from plait.export import export

    ded, col = _rows(placements["dedicated"]), _rows(placements["colocated"])
    assert [r["step"] for r in ded] == [r["step"] for r in col] == list(range(1, STEPS + 1))
    for a, b in zip(ded, col):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5, (a, b)
    assert ded[-1]["loss"] < ded[0]["loss"] - 0.3  # the job learns: the comparison is not of two idle runs
    got = {name: load_file(str(export(run))) for name, run in placements.items()}
    assert max_diff(got["dedicated"], got["colocated"]) <= 1e-5
    summary = json.loads((placements["colocated"] / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["parallel"]["strategy"] == "ps-sync: 2 workers serving 1/2 each (colocated)"
    # Bytes a worker (the chief) pushes per step: all gradients to a dedicated server; with colocation all but its
    # own shard (row block 0 of every tensor): (dp - 1) / dp of them.
    from plait.data import build_data
    from plait.models import build_model

    cfg = load_config(None, SGD)
    model = build_model(cfg.model, build_data(cfg.data, cfg.model).spec)
    assert all(q.shape[0] % 2 == 0 for q in model.parameters())  # two row blocks of every tensor are equal halves
    total = sum(q.numel() * 4 for q in model.parameters())
    assert all(r["comm_bytes"] == total for r in ded)
    assert all(r["comm_bytes"] == total * (2 - 1) / 2 for r in col)
