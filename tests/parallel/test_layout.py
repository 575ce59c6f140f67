"""plait.parallel.layout: degrees, the arithmetic and its messages, roles and mesh coordinates; checks before launch."""

import itertools
import re

import pytest

from plait.config import Config, dump_config, format_config, keys, load_config, opt, unregister
from plait.errors import ConfigError
from plait.parallel import SCHEMES, Scheme, check_config, step_owner
from plait.parallel.layout import Layout, resized
from plait.train.job import load_job


def bad(overrides: list[str], message: str) -> None:
    """load_job with these overrides raises ConfigError containing `message` verbatim."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_job(None, overrides)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["launch.nproc_per_node=3"],
         "the layout needs dp(2) * tp(1) * pp(1) = 2 processes but the launch gives nproc_per_node(3) * nnodes(1) = 3"),
        (["parallel.dp=4", "train.global_batch_size=64", "launch.nproc_per_node=2"],
         "dp(4) * tp(1) * pp(1) = 4 processes but the launch gives nproc_per_node(2) * nnodes(1) = 2"),
        (["parallel.dp=1", "launch.nproc_per_node=2", "launch.nnodes=2", "launch.rdzv_endpoint=h:1"],
         "dp(1) * tp(1) * pp(1) = 1 processes but the launch gives nproc_per_node(2) * nnodes(2) = 4"),
    ],
)
def test_layout_must_match_the_launch(overrides, message):
    bad(overrides, message)


def test_uneven_split_over_nodes_says_so():
    bad(["parallel.dp=3", "train.global_batch_size=48", "launch.nnodes=2", "launch.rdzv_endpoint=h:1"],
        "dp(3) * tp(1) * pp(1) = 3 processes cannot be split evenly over launch.nnodes = 2")


def test_global_batch_must_divide_by_micro_times_dp():
    bad(["train.global_batch_size=30", "train.micro_batch_size=8"],
        "train.global_batch_size (30) must be divisible by train.micro_batch_size (8) * parallel.dp (2) = 16; "
        "change train.global_batch_size to a multiple of 16 or lower train.micro_batch_size")


def test_the_world_size_is_checked_with_the_arithmetic():
    with pytest.raises(ConfigError, match=re.escape(
            "the layout needs dp(2) * tp(2) * pp(2) = 8 processes but this job has WORLD_SIZE = 4; change parallel.dp")):
        Layout(2, 2, 2).check_world(4)
    Layout(2, 2, 2).check_world(8)


# ---- Layout.resolve: the one place a degree is derived from a world size (issue 56 item 5)

AUTO = ["train.global_batch_size=64", "train.micro_batch_size=4"]


def auto_job(sets: list[str], dp="auto", **parallel) -> Config:
    """A config with these overrides and parallel.dp = dp ("auto" stays "auto": load_config would resolve it here)."""
    cfg = load_config(None, [*AUTO, *sets])
    for key, value in {"dp": dp, **parallel}.items():
        setattr(cfg.parallel, key, value)
    return cfg


@pytest.mark.parametrize("sets, world, degrees", [
    ([], 4, dict(dp=4, tp=1, pp=1, cp=1, ep=1)),
    (["parallel.tp=2"], 4, dict(dp=2, tp=2, pp=1, cp=1, ep=1)),
    (["parallel.pp=2"], 4, dict(dp=2, tp=1, pp=2, cp=1, ep=1)),
    (["parallel.cp=2"], 2, dict(dp=1, tp=1, pp=1, cp=2, ep=1)),  # the bug: dp = 2, four processes, before
    (["parallel.cp=2"], 4, dict(dp=2, tp=1, pp=1, cp=2, ep=1)),
    (["parallel.cp=2", "parallel.tp=2", "parallel.pp=2"], 16, dict(dp=2, tp=2, pp=2, cp=2, ep=1)),
    (["parallel.ep=2", "model.moe_experts=4"], 4, dict(dp=4, tp=1, pp=1, cp=1, ep=2)),
    (["parallel.sync='ps'", "parallel.ps_servers=1"], 3, dict(dp=2, tp=1, pp=1, cp=1, ep=1)),  # a server beside
])
def test_resolve_derives_dp_from_the_world_and_keeps_every_other_degree(sets, world, degrees):
    layout = Layout.resolve(auto_job(sets), world)
    assert {k: getattr(layout, k) for k in degrees} == degrees
    assert layout.world_size == world


@pytest.mark.parametrize("parallel, world, message", [
    (dict(cp=2), 3, "no whole parallel.dp fits WORLD_SIZE = 3 processes: dp * cp(2) * tp(1) * pp(1) = 3 leaves "
                    "dp = 3 / 2; give the job a multiple of 2 processes, or change parallel.cp"),
    (dict(tp=2, pp=2), 2,
     "no whole parallel.dp fits WORLD_SIZE = 2 processes: dp * tp(2) * pp(2) = 2 leaves dp = 2 / 4; give the job a "
     "multiple of 4 processes, or change parallel.tp or parallel.pp"),
    (dict(sync="ps", ps_servers=2), 2,
     "no whole parallel.dp fits WORLD_SIZE = 2 processes: dp * tp(1) * pp(1) + ps_servers(2) = 2 leaves dp = 0 / 1; "
     "give the job 2 + a multiple of 1 processes, or change parallel.ps_servers"),
    (dict(ep=4), 6,
     "no whole parallel.dp fits WORLD_SIZE = 6 processes with parallel.ep = 4: dp * tp(1) * pp(1) = 6 gives dp = 6, "
     "not a multiple of ep(4) (an expert-parallel group is ep dp ranks); give the job a multiple of 4 processes, or "
     "change parallel.ep"),
    (dict(cp=0), 2, "parallel.cp = 0 must be >= 1; set --set parallel.cp=1"),
    # a number is checked, not derived: torchtitan's dp * tp * pp != WORLD_SIZE
    (dict(dp=2, tp=2, pp=2), 4, "the layout needs dp(2) * tp(2) * pp(2) = 8 processes but WORLD_SIZE = 4; change "
                                "parallel.dp"),
    (dict(dp=1, cp=2), 4, "the layout needs dp(1) * cp(2) * tp(1) * pp(1) = 2 processes but WORLD_SIZE = 4; change "
                          "parallel.dp"),
])
def test_resolve_refuses_an_impossible_world_showing_the_arithmetic(parallel, world, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        Layout.resolve(auto_job(["model.moe_experts=4"], **parallel), world)


def test_resized_keeps_zero_while_a_cp_group_still_has_two_replicas():
    cp = resized(auto_job(["parallel.cp=2", "parallel.zero=3"]), 2)
    assert (cp.parallel.dp, cp.parallel.cp, cp.parallel.zero) == (1, 2, 3)  # ZeRO-3 over the cp group's 2 ranks
    one = resized(auto_job(["parallel.zero=1", "parallel.offload='disk'"]), 1)
    assert (one.parallel.dp, one.parallel.zero, one.parallel.offload) == (1, 0, "none")  # nothing left to shard over
    ensemble = resized(auto_job(["model.name='mlp'", "data.name='digits'", "model.ensemble=2"]), 4)
    assert ensemble.parallel.dp == 4 and Layout.from_config(ensemble).members == 2


@pytest.mark.parametrize(
    "global_, micro, dp, accum",
    [(32, 16, 2, 1), (64, 8, 2, 4), (24, 4, 3, 2), (8, 8, 1, 1), (96, 4, 4, 6)],
)
def test_grad_accum(global_, micro, dp, accum):
    cfg = load_job(None, [f"train.global_batch_size={global_}", f"train.micro_batch_size={micro}", f"parallel.dp={dp}"])
    layout = Layout.from_config(cfg)
    assert layout.grad_accum == accum
    assert layout.grad_accum * micro * dp == global_
    assert layout.local_batch == global_ // dp


@pytest.mark.parametrize(
    "dp, nnodes, nproc, expected",
    [(2, 1, 0, 2), (4, 2, 0, 2), (8, 4, 0, 2), (1, 2, 0, 1), (3, 1, 0, 3), (2, 1, 2, 2), (6, 2, 3, 3)],
)
def test_nproc_per_node(dp, nnodes, nproc, expected):
    cfg = Config()
    cfg.parallel.dp, cfg.launch.nnodes, cfg.launch.nproc_per_node = dp, nnodes, nproc
    cfg.train.global_batch_size = 16 * dp
    layout = Layout.from_config(cfg)
    assert layout.procs_per_node(cfg.max_nodes, nproc) == expected
    assert layout.world_size == dp


def test_mesh_coordinates_put_tensor_parallel_innermost():
    layout = Layout(dp=2, tp=2, pp=2)
    coords = [layout.coords(r) for r in range(8)]
    assert [(c["pp"], c["dp"], c["tp"]) for c in coords] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert all(layout.role(r) == "trainer" for r in range(8))


def test_parameter_server_roles_and_the_workers_data_coordinates():
    cfg = load_job(None, ["model.name=mlp", "data.name=digits", "parallel.sync=ps", "parallel.dp=3",
                          "parallel.ps_servers=2", "train.global_batch_size=48"])
    layout = Layout.from_config(cfg)
    assert (layout.trainers, layout.world_size) == (3, 5)
    assert [layout.role(r) for r in range(5)] == ["trainer", "worker", "worker", "server", "server"]
    # every worker, the chief included, loads only its own slice of each global batch
    assert [layout.coords(r)["dp"] for r in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="rank 3 is a parameter server"):
        layout.coords(3)


def test_the_step_owner_is_the_first_scheme_that_applies():
    def owner(*overrides):
        return step_owner(load_config(None, list(overrides), validate=False)).name

    assert owner() == "ddp"
    assert owner("parallel.dp=1") == "single"
    assert owner("parallel.zero=1") == "zero1"
    assert owner("parallel.zero=3") == "fsdp"
    assert owner("parallel.zero=3", "parallel.tp=2") == "fsdp"
    assert owner("parallel.tp=2") == "ddp"  # tensor parallel is a transform; dp averages by hand
    assert owner("parallel.pp=2", "parallel.tp=2") == "pipeline"
    assert owner("parallel.sync=gossip") == "gossip"
    assert owner("parallel.sync=ps") == "parameter_server"
    assert owner("parallel.embedding_sharding=row") == "embedding_sharding"


def test_a_new_scheme_is_one_object_with_keys_of_its_own():
    """A toy scheme declares a key and the scheme; plait.config does not change, and the key is a key like any other:
    loaded, checked by its declared rule and by the scheme, listed by `plait config show`, written and read back."""

    @keys("parallel")
    class ToyKeys:
        toy_degree: int = opt(1, "toy: how many toys per rank", minimum=1)

    def check(layout, k):
        if k.toy_degree == 3:
            raise ConfigError("parallel.toy_degree = 3 is refused by the toy scheme")

    try:
        toy = Scheme("toy", keys=ToyKeys, applies=lambda layout, k: k.toy_degree == 2 and layout.dp == 2, check=check,
                     strategy=lambda b: "toy-strategy")
        schemes = [toy, *SCHEMES]
        cfg = load_config(None, ["parallel.toy_degree=2"])
        assert cfg.parallel.toy_degree == 2 and cfg.keys(ToyKeys) == ToyKeys(toy_degree=2)
        assert step_owner(cfg, schemes) is toy
        assert step_owner(load_config(None, []), schemes).name == "ddp"
        with pytest.raises(ConfigError, match=re.escape("parallel.toy_degree = 3 is refused by the toy scheme")):
            check_config(load_config(None, ["parallel.toy_degree=3"]), schemes)
        with pytest.raises(ConfigError, match=re.escape("parallel.toy_degree = 0 must be >= 1; set --set "
                                                        "parallel.toy_degree=<value >= 1>")):
            load_config(None, ["parallel.toy_degree=0"])
        assert re.search(r"^toy_degree = 1 +# toy: how many toys per rank$", format_config(Config()), re.M)
        assert load_config_text(dump_config(cfg)).parallel.toy_degree == 2
    finally:
        unregister(ToyKeys)
    with pytest.raises(ConfigError, match=re.escape("unknown key 'parallel.toy_degree'")):
        load_config(None, ["parallel.toy_degree=2"])


def load_config_text(text: str) -> Config:
    import tomllib

    from plait.config import config_from_dict

    return config_from_dict(tomllib.loads(text))


def _grid():
    for dp, tp, pp, zero, ep, sync in itertools.product((1, 2, 4), (1, 2), (1, 2), (0, 1, 2, 3), (1, 2),
                                                        ("allreduce", "ps", "gossip")):
        sets = [f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.zero={zero}",
                f"parallel.ep={ep}", f"parallel.sync='{sync}'", "train.global_batch_size=16", "train.micro_batch_size=2",
                "optim.name='sgd'"]
        if ep > 1:
            sets.append("model.moe_experts=4")
        yield sets


def test_every_scheme_and_layout_agree_on_the_step_owner_and_the_predicates():
    """Over a grid of layouts (dp, tp, pp, ZeRO, ep, sync), every one the checks accept has the step owner its
    predicates name, and every one they refuse is refused with a ConfigError naming a key."""
    owners, refused = {}, 0
    for sets in _grid():
        cfg = load_config(None, sets)
        try:
            layout = check_config(cfg)
        except ConfigError as e:
            assert re.search(r"(parallel|model|precision|optim|train)\.\w+", str(e)), str(e)
            refused += 1
            continue
        owner = step_owner(cfg).name
        owners[owner] = owners.get(owner, 0) + 1
        expected = ("pipeline" if layout.pp > 1 else "parameter_server" if layout.ps else
                    "gossip" if layout.sync == "gossip" else "expert" if layout.ep > 1 else
                    "zero1" if layout.shards_optimizer and layout.zero == 1 else
                    "fsdp" if layout.shards_gradients else "ddp" if layout.dp > 1 else "single")
        assert owner == expected, (sets, owner, expected)
        # what each predicate says, against the owner
        assert layout.plain_data_parallel == (owner in ("ddp", "single") and layout.tp == 1), (sets, owner)
        assert layout.data_parallel_only == (owner in ("ddp", "single", "zero1", "fsdp") and layout.tp == 1), sets
        assert layout.outputs_on_one_rank == (owner not in ("pipeline", "parameter_server")), sets
        assert layout.every_rank_evaluates == (owner != "parameter_server"), sets
        assert layout.elementwise_optimizer_only == (layout.zero >= 2), sets
        assert layout.splits_model == (layout.tp > 1 or owner == "pipeline"), sets
        assert layout.world_size == layout.dp * layout.tp * layout.pp + layout.ps_servers
    assert set(owners) == {"single", "ddp", "zero1", "fsdp", "pipeline", "parameter_server", "gossip", "expert"}
    assert refused > 0 and sum(owners.values()) + refused == 3 * 2 * 2 * 4 * 2 * 3
