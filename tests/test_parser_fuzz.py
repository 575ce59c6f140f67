"""The parsers of files a user may be handed (issue 37): random, truncated and bit-flipped inputs get plait's own
one-line error, never a traceback or a hang. Hugging Face config.json and index, LitData's index.json, .pt2 and
ONNX archives, serve and fed token files."""

import json
import zipfile
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from plait.data.packed import check_split
from plait.errors import PlaitError
from plait.federated.wire import parse_tokens
from plait.models.hf import read_hf_config
from plait.models.lazy import shard_files
from plait.serve.cli import serve_token

FUZZ = settings(max_examples=60, deadline=5000, suppress_health_check=[HealthCheck.function_scoped_fixture])
scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=12)
json_values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4)
                           | st.dictionaries(st.text(max_size=12), kids, max_size=4), max_leaves=12)
hf_keys = st.sampled_from(["architectures", "model_type", "n_embd", "n_layer", "n_head", "vocab_size",
                           "activation_function", "hidden_size", "num_attention_heads", "num_hidden_layers",
                           "intermediate_size", "rope_theta", "tie_word_embeddings", "n_positions", "n_inner"])
hf_configs = st.dictionaries(hf_keys, json_values | st.sampled_from(["GPT2LMHeadModel", "LlamaForCausalLM", "gpt2",
                                                                      "llama", ["LlamaForCausalLM"]]), max_size=10)


def one_line(e: BaseException) -> None:
    assert isinstance(e, PlaitError), f"{type(e).__name__}: {e}"
    assert str(e) and "\n" not in str(e), str(e)


def mutate(data: bytes, cut: int, flips: list[tuple[int, int]]) -> bytes:
    out = bytearray(data[:cut % (len(data) + 1)])
    for pos, byte in flips:
        if out:
            out[pos % len(out)] = byte
    return bytes(out)


bytes_edits = st.tuples(st.integers(0, 1 << 20), st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)),
                                                           max_size=6))


@FUZZ
@given(config=hf_configs | json_values, raw=st.none() | st.binary(max_size=64))
def test_hf_config_json(tmp_path, config, raw):
    (tmp_path / "config.json").write_bytes(raw if raw is not None else json.dumps(config).encode())
    try:
        read_hf_config(tmp_path)
    except Exception as e:  # noqa: BLE001 -- anything but plait's own one-line error fails the test
        one_line(e)


@FUZZ
@given(index=json_values | st.fixed_dictionaries({"weight_map": json_values}), raw=st.none() | st.binary(max_size=64))
def test_hf_shard_index(tmp_path, index, raw):
    (tmp_path / "model.safetensors.index.json").write_bytes(raw if raw is not None else json.dumps(index).encode())
    try:
        shard_files(tmp_path, "fuzz")
    except Exception as e:  # noqa: BLE001
        one_line(e)


@FUZZ
@given(index=json_values | st.fixed_dictionaries({"chunks": json_values, "config": json_values})
       | st.fixed_dictionaries({"chunks": st.lists(st.dictionaries(st.sampled_from(
           ["filename", "chunk_bytes", "chunk_size"]), json_values)), "config": st.fixed_dictionaries(
           {"data_format": json_values, "data_spec": json_values | st.text(max_size=40)})}),
       raw=st.none() | st.binary(max_size=64))
def test_litdata_index(tmp_path, index, raw):
    (tmp_path / "index.json").write_bytes(raw if raw is not None else json.dumps(index).encode())
    try:
        check_split(tmp_path, 3)
    except Exception as e:  # noqa: BLE001
        one_line(e)


@FUZZ
@given(text=st.text(max_size=80), raw=st.none() | st.binary(max_size=40))
def test_token_files(tmp_path, text, raw):
    f = tmp_path / "token"
    f.write_bytes(raw if raw is not None else text.encode("utf-8", "surrogatepass"))
    for read in (lambda: serve_token(SimpleNamespace(token=None, token_file=str(f))),
                 lambda: parse_tokens(f.read_bytes().decode("utf-8", "replace"))):
        try:
            token = read()
        except Exception as e:  # noqa: BLE001
            one_line(e)
        else:
            assert token


@pytest.fixture(scope="module")
def pt2_bytes(tmp_path_factory) -> bytes:
    from plait.edge.formats import write_pt2

    out = tmp_path_factory.mktemp("pt2") / "m.pt2"
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()).eval()
    batch = torch.export.Dim("batch", max=64)
    write_pt2(module, torch.randn(2, 4), out, {"plait.model": "{}"}, ({0: batch},), aoti=False)
    return out.read_bytes()


@FUZZ
@given(edit=bytes_edits)
def test_pt2_archives(tmp_path, pt2_bytes, edit):
    from plait.edge.formats import load_pt2

    f = tmp_path / "m.pt2"
    f.write_bytes(mutate(pt2_bytes, *edit))
    try:
        load_pt2(f)
    except Exception as e:  # noqa: BLE001
        one_line(e)


@FUZZ
@given(entry=st.sampled_from(["models/model.json", "data/weights/model_weights_config.json",
                              "data/constants/model_constants_config.json"]),
       value=json_values, raw=st.none() | st.binary(max_size=64))
def test_pt2_json_entries(tmp_path, pt2_bytes, entry, value, raw):
    from plait.edge.archive import check_pt2

    src, f = tmp_path / "src.pt2", tmp_path / "m.pt2"
    src.write_bytes(pt2_bytes)
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(f, "w") as w:
        for name in z.namelist():
            keep = name.split("/", 1)[1] != entry
            w.writestr(name, z.read(name) if keep else (raw if raw is not None else json.dumps(value).encode()))
    try:
        check_pt2(f)
    except Exception as e:  # noqa: BLE001
        one_line(e)


@pytest.fixture(scope="module")
def onnx_bytes(tmp_path_factory) -> bytes:
    pytest.importorskip("onnx", reason="the edge extra is not installed: pip install 'plait[edge]'")
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2])
    w = helper.make_tensor("w", TensorProto.FLOAT, [2], [0.5, -1.0])
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["logits"])], "g", [x], [y], initializer=[w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.metadata_props.add(key="plait.batch", value="dynamic")
    return model.SerializeToString()


@FUZZ
@given(edit=bytes_edits)
@example(edit=(2222, [(21453, 128)]))  # found by this test: metadata that is not UTF-8 (onnxruntime's UnicodeDecodeError)
def test_onnx_files(tmp_path, onnx_bytes, edit):
    pytest.importorskip("onnxruntime", reason="the edge extra is not installed: pip install 'plait[edge]'")
    from plait.edge.formats import load_onnx

    f = tmp_path / "m.onnx"
    f.write_bytes(mutate(onnx_bytes, *edit))
    try:
        load_onnx(f, threads=1)
    except Exception as e:  # noqa: BLE001
        one_line(e)

