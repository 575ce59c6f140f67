"""plait.models.lazy: every view reads, for any index, exactly what the whole tensor holds there."""

import itertools

import pytest
import torch
from safetensors.torch import save_file

from plait.errors import ConfigError
from plait.models.lazy import open_weights, safetensors_file, stack


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    d = tmp_path_factory.mktemp("lazy")
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(6, 4, generator=g), "b": torch.randn(9, generator=g).to(torch.bfloat16),
               **{f"e{i}": torch.randn(5, 3, generator=g) for i in range(3)}}
    save_file(tensors, str(d / "model.safetensors"))
    return tensors, open_weights(d, "test")


def indices(shape):
    """Every (start, stop) per dimension on a small grid, empty ranges included."""
    spans = [[slice(a, b) for a in range(0, n + 1, 2) for b in range(a, n + 1, 3)] for n in shape]
    return itertools.product(*spans)


def check(view, want):
    assert view.shape == tuple(want.shape) and view.dtype == want.dtype
    assert torch.equal(view.full(), want)
    for index in indices(want.shape):
        assert torch.equal(view.read(index), want[index]), index


def test_stored_transposed_rows_chunks(stored):
    tensors, src = stored
    check(src["a"], tensors["a"])
    check(src["b"], tensors["b"])  # bf16 read as bf16
    check(src["a"].t(), tensors["a"].t())
    check(src["a"].rows(1, 5), tensors["a"][1:5])
    for got, want in zip(src["a"].t().chunk(2), tensors["a"].t().chunk(2), strict=True):  # GPT-2's fused c_attn
        check(got, want)


def test_stacked_and_padded(stored):
    tensors, src = stored
    experts = [src[f"e{i}"].t() for i in range(3)]  # Mixtral: per-expert Linear weights, stacked and transposed
    check(stack(experts), torch.stack([tensors[f"e{i}"].t() for i in range(3)]))
    padded = torch.cat([tensors["a"], torch.zeros(3, 4)])  # a vocabulary padded with zero rows
    check(src["a"].pad_rows(9), padded)
    assert src["a"].pad_rows(6) is src["a"]


def test_a_file_that_is_not_safetensors_is_named(tmp_path):
    (tmp_path / "x.safetensors").write_bytes(b"not a header")
    with pytest.raises(ConfigError, match=r"^train.init_from = 'x': x.safetensors is not a readable safetensors file"):
        safetensors_file(tmp_path / "x.safetensors", "train.init_from = 'x'")
    with pytest.raises(ConfigError, match=r"has no weights: expected one of model.safetensors, "):
        open_weights(tmp_path, "train.init_from = 'x'")


def test_a_hostile_or_broken_directory_is_one_line_each(tmp_path):
    """Issue 37 N12: an index naming shards outside the directory, a malformed index, a pickle that would run code and
    a config.json nested 100,000 deep are refused with one line, and the outside shard is never read."""
    import json
    import pickle

    from plait.models.hf import read_hf_config

    outside = tmp_path / "outside.safetensors"
    save_file({"w": torch.ones(2)}, str(outside))
    d = tmp_path / "hf"
    d.mkdir()
    for name in (str(outside), "../outside.safetensors"):
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": name}}))
        with pytest.raises(ConfigError, match=r"^x: model.safetensors.index.json names the shard .* outside the "
                                              r"directory; shards must be files next to the index$"):
            open_weights(d, "x")
    for text in ("[1, 2", '{"weight_map": 3}', "[]"):
        (d / "model.safetensors.index.json").write_text(text)
        with pytest.raises(ConfigError, match=r"^x: model.safetensors.index.json is not an index of shards"):
            open_weights(d, "x")
    (d / "model.safetensors.index.json").unlink()
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (d / "pytorch_model.bin").write_bytes(pickle.dumps({"w": Payload()}))
    with pytest.raises(ConfigError, match=r"^x: pytorch_model.bin is not a plain state dict torch loads without "
                                          r"running code \(UnpicklingError"):
        open_weights(d, "x")
    assert not marker.exists()
    (d / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match=r"config.json is not readable JSON \(RecursionError"):
        read_hf_config(d)
