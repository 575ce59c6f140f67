"""The typed config: defaults, TOML loading, --set overrides, section-level validation messages, dump/format.

Rules that need a model or a scheme are tested with them (tests/models, tests/parallel)."""

import dataclasses
import re
import tomllib

import pytest

from plait.config import (
    SECTIONS,
    Config,
    apply_overrides,
    config_to_dict,
    dump_config,
    format_config,
    load_config,
    parse_override,
    set_value,
    toml_key,
    validate_config,
)
from plait.errors import ConfigError, PlaitError


def bad(overrides: list[str], message: str) -> None:
    """load_config with these overrides raises ConfigError containing `message` verbatim."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)


# --------------------------------------------------------------------------- defaults


def test_defaults_load_and_validate():
    cfg = load_config()
    assert cfg == Config()
    assert validate_config(cfg) is cfg
    assert (cfg.model.name, cfg.data.name, cfg.parallel.dp) == ("gpt", "stdlib-text", 2)
    assert cfg.optim.betas == [0.9, 0.95] and cfg.model.options == {}


def test_default_containers_are_not_shared_between_configs():
    a, b = Config(), Config()
    a.model.options["x"] = 1
    a.optim.betas.append(0.5)
    assert b.model.options == {} and b.optim.betas == [0.9, 0.95]


# --------------------------------------------------------------------------- TOML files

EVERY_SECTION = """
[model]
name = "mlp"
width = 48
depth = 3
dropout = 0
options = { unused = 1 }

[data]
name = "digits"
val_fraction = 0.25
prefetch = 0

[train]
steps = 7
global_batch_size = 24
micro_batch_size = 4
seed = 9
sample_prompt = "x = "

[optim]
name = "sgd"
lr = 1
betas = [0.5, 0.75]
schedule = "constant"

[parallel]
dp = 3
tp = 1
pp = 1

[precision]
dtype = "bf16"

[checkpoint]
every = 0
keep = 1

[launch]
nproc_per_node = 3
backend = "gloo"
device = "cpu"
timeout_s = 30

[log]
every = 2
progress = false
report = false
"""


def test_toml_file_with_every_section(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(EVERY_SECTION)
    cfg = load_config(path)
    assert (cfg.model.name, cfg.model.width, cfg.model.depth, cfg.model.options) == ("mlp", 48, 3, {"unused": 1})
    assert (cfg.data.name, cfg.data.val_fraction, cfg.data.prefetch) == ("digits", 0.25, 0)
    assert (cfg.train.steps, cfg.train.global_batch_size, cfg.train.micro_batch_size) == (7, 24, 4)
    assert (cfg.train.seed, cfg.train.sample_prompt) == (9, "x = ")
    assert (cfg.optim.name, cfg.optim.betas, cfg.optim.schedule) == ("sgd", [0.5, 0.75], "constant")
    assert (cfg.parallel.dp, cfg.precision.dtype) == (3, "bf16")
    assert (cfg.checkpoint.every, cfg.checkpoint.keep) == (0, 1)
    assert (cfg.launch.nproc_per_node, cfg.launch.backend, cfg.launch.device, cfg.launch.timeout_s) == (
        3, "gloo", "cpu", 30)
    assert (cfg.log.every, cfg.log.progress, cfg.log.report) == (2, False, False)
    # ints are accepted for floats, and stored as floats
    assert cfg.optim.lr == 1.0 and type(cfg.optim.lr) is float
    assert cfg.model.dropout == 0.0 and type(cfg.model.dropout) is float
    # untouched keys keep their defaults
    assert cfg.optim.eps == 1e-8 and cfg.train.eval_samples == 256


def test_overrides_apply_on_top_of_the_file(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(EVERY_SECTION)
    cfg = load_config(path, ["train.steps=11", "parallel.dp=1", "launch.nproc_per_node=0", "train.global_batch_size=8"])
    assert (cfg.train.steps, cfg.parallel.dp, cfg.launch.nproc_per_node) == (11, 1, 0)
    assert cfg.model.width == 48  # from the file


def test_missing_file_and_invalid_toml(tmp_path):
    with pytest.raises(ConfigError, match=r"config file '.*nope\.toml' does not exist"):
        load_config(tmp_path / "nope.toml")
    path = tmp_path / "broken.toml"
    path.write_text("[train\nsteps = 3\n")
    with pytest.raises(ConfigError, match=r"broken\.toml is not valid TOML"):
        load_config(path)


def test_unknown_section_in_file(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[trainer]\nsteps = 3\n")
    with pytest.raises(ConfigError, match=re.escape(
            f"unknown section [trainer] in {path}; valid sections: model, data, train, optim, parallel, precision, "
            "checkpoint, launch, log")):
        load_config(path)


def test_section_that_is_not_a_table(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("model = 3\n")
    with pytest.raises(ConfigError, match=re.escape(f"[model] in {path} must be a table of keys, not 3")):
        load_config(path)


def test_unknown_key_in_file_names_file_and_suggests(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[model]\nwidht = 3\n")
    with pytest.raises(ConfigError, match=re.escape(f"unknown key 'model.widht' in {path}")) as e:
        load_config(path)
    assert "(did you mean model.width?)" in str(e.value)


def test_wrong_type_in_file(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[train]\nsteps = "many"\n')
    with pytest.raises(ConfigError, match=re.escape("train.steps = 'many' has the wrong type: it must be an integer")):
        load_config(path)


# --------------------------------------------------------------------------- --set overrides


@pytest.mark.parametrize(
    "text, key, value",
    [
        ("train.steps=100", "train.steps", 100),
        ("  train.steps =  7 ", "train.steps", 7),
        ("optim.lr=1e-3", "optim.lr", 0.001),
        ("optim.lr=2.5", "optim.lr", 2.5),
        ("log.progress=false", "log.progress", False),
        ("train.compile=true", "train.compile", True),
        ("optim.betas=[0.8, 0.99]", "optim.betas", [0.8, 0.99]),
        ("model.options={in_features = 4, bias = false}", "model.options", {"in_features": 4, "bias": False}),
        ('train.sample_prompt="a=b c"', "train.sample_prompt", "a=b c"),
        ("data.name=digits", "data.name", "digits"),  # unquoted, not TOML: the plain string
        ("data.path=/tmp/my data/x.txt", "data.path", "/tmp/my data/x.txt"),
        ("launch.rdzv_endpoint=10.0.0.1:29500", "launch.rdzv_endpoint", "10.0.0.1:29500"),
        ("train.sample_prompt=", "train.sample_prompt", ""),
    ],
)
def test_parse_override_reads_toml_literals(text, key, value):
    got_key, got = parse_override(text)
    assert got_key == key
    assert got == value and type(got) is type(value)


def test_parse_override_needs_an_equals_sign():
    with pytest.raises(ConfigError, match=re.escape("--set 'train.steps' must be of the form section.key=value")):
        parse_override("train.steps")


def test_apply_overrides_in_order_and_int_for_float():
    cfg = Config()
    out = apply_overrides(cfg, ["train.steps=5", "optim.lr=1", "train.steps=6", "data.name=digits",
                                "optim.betas=[0.5, 0.25]", "model.options={a = 1}"])
    assert out is cfg
    assert cfg.train.steps == 6  # the later override wins
    assert cfg.optim.lr == 1.0 and type(cfg.optim.lr) is float
    assert (cfg.data.name, cfg.optim.betas, cfg.model.options) == ("digits", [0.5, 0.25], {"a": 1})


def test_set_value_checks_the_dotted_form():
    with pytest.raises(ConfigError, match=re.escape(
            "'train.steps.x' from --set is not of the form section.key (e.g. train.steps)")):
        set_value(Config(), "train.steps.x", 1)
    with pytest.raises(ConfigError, match=re.escape("'steps' from --set is not of the form section.key")):
        set_value(Config(), "steps", 1)


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.steps=abc", "train.steps = 'abc' has the wrong type: it must be an integer; "
                            "fix the value in the config or --set train.steps=<an integer>"),
        ("train.steps=1.5", "train.steps = 1.5 has the wrong type: it must be an integer"),
        ("train.steps=true", "train.steps = True has the wrong type: it must be an integer"),
        ("optim.lr=true", "optim.lr = True has the wrong type: it must be a number"),
        ("optim.lr=fast", "optim.lr = 'fast' has the wrong type: it must be a number"),
        ("log.progress=1", "log.progress = 1 has the wrong type: it must be true or false"),
        ("optim.betas=0.9", "optim.betas = 0.9 has the wrong type: it must be a list"),
        ("model.options=[1]", "model.options = [1] has the wrong type: it must be a table"),
    ],
)
def test_wrong_types(override, message):
    bad([override], message)


def test_unquoted_string_values_are_taken_literally():
    cfg = load_config(None, ["data.path=2024-01-01", "train.sample_prompt=1", "model.factory=pkg.mod:fn"],
                      validate=False)
    assert (cfg.data.path, cfg.train.sample_prompt, cfg.model.factory) == ("2024-01-01", "1", "pkg.mod:fn")


def test_a_number_for_a_string_key_in_a_file_is_a_type_error(tmp_path):
    (tmp_path / "c.toml").write_text("[data]\npath = 3\n")
    with pytest.raises(ConfigError, match=re.escape("data.path = 3 has the wrong type: it must be a string")):
        load_config(tmp_path / "c.toml")


def test_unknown_section_in_override():
    bad(["trainer.steps=3"], "unknown section 'trainer' in 'trainer.steps' from --set trainer.steps=3; "
                             "valid sections: model, data, train")


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.step=5"])
    msg = str(e.value)
    assert msg.startswith("unknown key 'train.step' in --set train.step=5; keys of [train]: steps, stop_after, ")
    assert msg.endswith(" (did you mean train.steps?)")
    for f in dataclasses.fields(SECTIONS["train"]):
        assert toml_key(f.name) in msg


def test_unknown_key_without_a_close_one_has_no_hint():
    with pytest.raises(ConfigError, match=re.escape("unknown key 'optim.learning_rate'")) as e:
        load_config(None, ["optim.learning_rate=0.1"])
    assert "did you mean" not in str(e.value)


def test_unknown_key_hint_in_a_one_key_section():
    with pytest.raises(ConfigError, match=re.escape("(did you mean precision.dtype?)")):
        load_config(None, ["precision.dtyp=bf16"])


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.name=lion", "optim.name = 'lion' is not one of: adamw, sgd, lamb, lars, adamw8bit; set one of those"),
        ("optim.schedule=linear", "optim.schedule = 'linear' is not one of: cosine, constant"),
        ("precision.dtype=fp8", "precision.dtype = 'fp8' is not one of: fp32, bf16, fp16"),
        ("data.name=csv", "data.name = 'csv' is not one of: stdlib-text, digits, synthetic, clicks, text, tensors"),
        ("launch.backend=mpi", "launch.backend = 'mpi' is not one of: auto, gloo, nccl"),
        ("launch.device=tpu", "launch.device = 'tpu' is not one of: auto, cpu, cuda"),
        ("launch.rdzv_backend=etcd", "launch.rdzv_backend = 'etcd' is not one of: c10d, static"),
    ],
)
def test_bad_choices(override, message):
    bad([override], message)


@pytest.mark.parametrize("model, data", [("gpt", "text"), ("mlp", "tensors")])
def test_file_sources_need_a_path(model, data):
    bad([f"model.name={model}", f"data.name={data}"],
        f"data.name = '{data}' needs data.path (a file or folder); set --set data.path=...")
    assert load_config(None, [f"model.name={model}", f"data.name={data}", "data.path=x"]).data.path == "x"


def test_multi_node_needs_a_rendezvous():
    multi = ["parallel.dp=4", "train.global_batch_size=64", "launch.nnodes=2"]
    bad(multi, "launch.nnodes = 2 needs launch.rdzv_endpoint = 'host:port' of node 0")
    assert load_config(None, multi + ["launch.rdzv_endpoint=10.0.0.1:29500"]).max_nodes == 2
    bad(multi + ["launch.rdzv_endpoint=node0"], "launch.rdzv_endpoint = 'node0' must be host:port")
    bad(multi + ["launch.rdzv_endpoint=h:1", "launch.node_rank=2"], "launch.node_rank = 2 must be < launch.nnodes = 2")


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.steps=0", "train.steps = 0 must be >= 1; set --set train.steps=<value >= 1>"),
        ("checkpoint.keep=0", "checkpoint.keep = 0 must be >= 1"),
        ("data.prefetch=-1", "data.prefetch = -1 must be >= 0"),
        ("optim.grad_clip=-0.5", "optim.grad_clip = -0.5 must be >= 0"),
        ("optim.lr=0", "optim.lr = 0.0 must be > 0"),
        ("data.val_fraction=1", "data.val_fraction = 1.0 must be between 0 and 1 (exclusive)"),
        ("data.val_fraction=0", "data.val_fraction = 0.0 must be between 0 and 1 (exclusive)"),
        ("model.dropout=1", "model.dropout = 1.0 must be in [0, 1)"),
        ("optim.betas=[0.9]", "optim.betas = [0.9] must be two numbers in [0, 1)"),
        ("optim.betas=[0.9, 1.0]", "optim.betas = [0.9, 1.0] must be two numbers in [0, 1)"),
    ],
)
def test_range_checks(override, message):
    bad([override], message)


def test_zero_synthetic_classes_is_a_user_error():
    from plait.data import build_data

    with pytest.raises(PlaitError, match="synthetic_classes"):
        cfg = load_config(None, ["model.name=mlp", "data.name=synthetic", "data.synthetic_classes=0",
                                 "data.synthetic_samples=16"])
        build_data(cfg.data, cfg.model)


def test_validate_false_skips_validation():
    cfg = load_config(None, ["train.steps=0"], validate=False)
    assert cfg.train.steps == 0
    with pytest.raises(ConfigError, match=re.escape("train.steps = 0 must be >= 1")):
        validate_config(cfg)


# --------------------------------------------------------------------------- dump / format


def _changed_config() -> Config:
    return load_config(None, [
        "model.name=mlp", "data.name=tensors", "data.path=/data/x y.npy", "model.width=40", "model.dropout=0.25",
        "model.options={a = 1, b = [1, 2], c = {d = 'e'}}", "optim.betas=[0.8, 0.99]", "optim.lr=0.000123",
        'train.sample_prompt="quote \\" and\\nnewline é"', "log.progress=false", "launch.timeout_s=17",
        "precision.dtype=fp16", "checkpoint.keep=5", "parallel.dp=1", "train.global_batch_size=48",
    ])


@pytest.mark.parametrize("make", [Config, _changed_config], ids=["default", "changed"])
def test_dump_then_load_round_trips(make, tmp_path):
    cfg = make()
    text = dump_config(cfg)
    assert tomllib.loads(text) == config_to_dict(cfg)
    path = tmp_path / "config.toml"
    path.write_text(text, encoding="utf-8")
    again = load_config(path)
    assert again == cfg
    assert type(again.optim.lr) is float and type(again.model.dropout) is float


def test_changed_config_really_changed():
    cfg = _changed_config()
    assert cfg.train.sample_prompt == 'quote " and\nnewline é'
    assert cfg.model.options == {"a": 1, "b": [1, 2], "c": {"d": "e"}}
    assert cfg != Config()


def test_format_config_lists_every_field_with_its_doc():
    cfg = Config()
    cfg.model.options = {"in_features": 4}
    cfg.optim.lr = 0.003
    text = format_config(cfg)
    blocks = {}
    for chunk in text.strip().split("\n\n"):
        header, *lines = chunk.splitlines()
        blocks[header] = lines
    assert list(blocks) == [f"[{s}]" for s in SECTIONS]
    assert list(SECTIONS) == ["model", "data", "train", "optim", "parallel", "precision", "checkpoint", "launch", "log",
                             "federated", "finetune", "distill"]
    for section, section_type in SECTIONS.items():
        lines = blocks[f"[{section}]"]
        fields = dataclasses.fields(section_type)
        assert len(lines) == len(fields)
        for line, f in zip(lines, fields):
            assignment, _, doc = line.partition(" # ")
            assert assignment.split(" = ")[0] == toml_key(f.name)
            assert doc == f.metadata["doc"] and doc
    model = dict(line.partition(" # ")[0].rstrip().split(" = ", 1) for line in blocks["[model]"])
    assert model["options"] == "{in_features = 4}"
    assert model["name"] == '"gpt"' and model["tie_embeddings"] == "true" and model["dropout"] == "0.0"
    optim = dict(line.partition(" # ")[0].rstrip().split(" = ", 1) for line in blocks["[optim]"])
    assert optim["betas"] == "[0.9, 0.95]" and optim["lr"] == "0.003"


def test_the_registries_names_are_the_configs_choices():
    """data.name's choices, model.name's description and log.trackers' check come from the registries' published
    (torch-free) names; each registry builds exactly those."""
    from plait.config import SECTIONS
    from plait.data.keys import SOURCE_NAMES
    from plait.data.sources import SOURCES
    from plait.models.keys import MODELS as MODEL_NAMES
    from plait.models.registry import MODELS
    from plait.report.trackers import TRACKERS

    data = {f.name: f for f in dataclasses.fields(SECTIONS["data"])}
    assert data["name"].metadata["choices"] == SOURCE_NAMES and set(SOURCES) == set(SOURCE_NAMES)
    model = {f.name: f for f in dataclasses.fields(SECTIONS["model"])}
    assert set(MODELS) == set(MODEL_NAMES) and ", ".join(MODEL_NAMES) in model["name"].metadata["doc"]
    with pytest.raises(ConfigError, match=re.escape(f"choose from {sorted(TRACKERS)}")):
        load_config(None, ["log.trackers=['visdom']"])
