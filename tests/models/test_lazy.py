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
