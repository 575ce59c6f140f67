"""A .pt2 is inspected before torch reads it: every way torch.export.load runs code from the file is refused, unless
--trust-checkpoint (issue 37 N1). Each attack is replayed twice: trusted, to show the payload really runs; then
the default, which must refuse it naming the entry and leave no marker."""

import io
import json
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

from plait.cli import main
from plait.edge import export_edge, load_edge
from plait.errors import CheckpointError
from serve_helpers import mlp_run  # noqa: F401


@pytest.fixture(scope="module")
def honest(mlp_run, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("pt2") / "model.pt2"
    export_edge(mlp_run, out, batch="dynamic")
    return out


class Payload:
    """Unpickling it creates `marker`: the proof that the file's code ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def rewrite(src: Path, dst: Path, edit) -> Path:
    """Copy the archive, letting edit(entries) change the {relative name: bytes} map."""
    with zipfile.ZipFile(src) as z:
        root = z.namelist()[0].split("/")[0]
        entries = {n.split("/", 1)[1]: z.read(n) for n in z.namelist()}
    edit(entries)
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as z:
        for rel, data in entries.items():
            z.writestr(f"{root}/{rel}", data)
    return dst


def pickled_weight(marker):
    def edit(e):
        config = json.loads(e["data/weights/model_weights_config.json"])
        fqn = next(iter(config["config"]))
        buf = io.BytesIO()
        torch.save(Payload(marker), buf)
        e["data/weights/weight_99"] = buf.getvalue()
        config["config"][fqn].update(path_name="weight_99", use_pickle=True)
        e["data/weights/model_weights_config.json"] = json.dumps(config).encode()
    return edit, "stores", "as a pickle or object"


def opaque_constant(marker):
    def edit(e):
        e["data/constants/opaque_obj_0"] = pickle.dumps(Payload(marker))
        e["data/constants/model_constants_config.json"] = json.dumps(
            {"config": {"c": {"path_name": "opaque_obj_0", "is_param": False, "use_pickle": True,
                              "tensor_meta": None}}}).encode()
    return edit, "holds 'data/constants/opaque_obj_0'", "which torch.export.save does not write"


def sample_inputs(marker):
    def edit(e):
        buf = io.BytesIO()
        torch.save((Payload(marker),), buf)
        e["data/sample_inputs/model.pt"] = buf.getvalue()
    return edit, "data/sample_inputs/model.pt is not plain tensors", ""


def shape_expression(marker):
    def edit(e):
        text = e["models/model.json"].decode()
        first = text.index('"expr_str": "') + len('"expr_str": "')  # a dynamic batch is a symbol: sympify'd on load
        code = f"__import__('builtins').open('{marker}', 'w') and "
        e["models/model.json"] = (text[:first] + code + text[first:]).encode()
    return edit, "holds a shape expression that is not plain arithmetic", ""


ATTACKS = {"pickled weight": pickled_weight, "opaque constant": opaque_constant, "sample inputs": sample_inputs,
           "shape expression": shape_expression}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_pt2_that_would_run_code_is_refused_before_torch_reads_it(honest, tmp_path, attack):
    marker = tmp_path / "ran"
    edit, *words = ATTACKS[attack](marker)
    bad = rewrite(honest, tmp_path / "bad.pt2", edit)
    with pytest.raises(CheckpointError) as e:
        load_edge(bad)
    assert not marker.exists()
    text = str(e.value)
    assert text.startswith(f"{bad}: ") and all(w in text for w in words), text
    assert "torch would run code from the file" in text and "--trust-checkpoint" in text
    try:  # trusted, torch reads the file, and the payload runs: the replay is a real attack
        load_edge(bad, trust=True)
    except Exception:
        pass
    assert marker.exists()


def graph_target(e):
    program = json.loads(e["models/model.json"])
    program["graph_module"]["graph"]["nodes"][0]["target"] = "torch.serialization.os.system"
    e["models/model.json"] = json.dumps(program).encode()


def aoti_library(e):
    e["data/aotinductor/model/model.so"] = b"\x7fELF"


@pytest.mark.parametrize("edit, words", [
    (graph_target, "calls 'torch.serialization.os.system', which is not a tensor operator"),
    (aoti_library, "it is an AOTInductor package (a compiled shared library)"),
    (lambda e: e.update({"data/weights/model.pt": b"legacy"}), "holds 'data/weights/model.pt'"),
    (lambda e: e.update({"models/model.json": b"[" * 100_000}), "is not JSON (RecursionError)"),
])
def test_graph_targets_native_code_and_unknown_entries_are_refused(honest, tmp_path, edit, words):
    bad = rewrite(honest, tmp_path / "bad.pt2", edit)
    with pytest.raises(CheckpointError) as e:
        load_edge(bad)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_honest_export_loads_and_plait_serve_refuses_the_attack_in_one_line(honest, tmp_path, capsys):
    module, meta = load_edge(honest)
    assert meta["plait.format"] == "pt2" and module(torch.zeros(3, 1, 8, 8)).shape == (3, 10)
    marker = tmp_path / "ran"
    bad = rewrite(honest, tmp_path / "bad.pt2", pickled_weight(marker)[0])
    assert main(["serve", str(bad), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "as a pickle or object" in err and not marker.exists()
