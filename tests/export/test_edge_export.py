"""Edge exports (plait.edge): ONNX through the dynamo exporter, onnxruntime int8, .pt2; each with its parity gate."""

from pathlib import Path

import numpy as np
import pytest
import torch

from plait.cli import main
from plait.config import load_config
from plait.data import build_data
from plait.data.spec import DataSpec
from plait.edge import export_edge, load_edge
from plait.edge.parity import HeldOut, Parity, compare
from plait.serve.model.load import ModelRef, load_model
from serve_helpers import gpt_run, mlp_run  # noqa: F401

onnx = pytest.importorskip("onnx", reason="the edge extra is not installed: pip install 'plait[edge]'")
ort = pytest.importorskip("onnxruntime", reason="the edge extra is not installed: pip install 'plait[edge]'")


@pytest.fixture(scope="module")
def eager(mlp_run):  # noqa: F811
    return load_model(ModelRef(str(mlp_run))).module


@pytest.fixture(scope="module")
def onnx_dynamic(mlp_run, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("edge") / "model.onnx"
    return out, export_edge(mlp_run, out, batch="dynamic")


def test_cli_exports_onnx_and_prints_its_parity(mlp_run, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "m.onnx"
    assert main(["export", str(mlp_run), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"wrote {out} (onnx, batch dynamic, " in text
    assert "parity on 179 validation inputs: max abs diff" in text and "[onnxruntime] -> ok" in text
    onnx.checker.check_model(str(out), full_check=True)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape == ["batch", 1, 8, 8]  # a batch axis of any size by default
    meta = session.get_modelmeta().custom_metadata_map
    assert meta["plait.batch"] == "dynamic" and '"name": "mlp"' in meta["plait.model"]
    fixed = tmp_path / "m1.onnx"
    assert main(["export", str(mlp_run), "-o", str(fixed), "--batch", "1"]) == 0
    assert f"wrote {fixed} (onnx, batch 1, " in capsys.readouterr().out
    assert ort.InferenceSession(str(fixed), providers=["CPUExecutionProvider"]).get_inputs()[0].shape == [1, 1, 8, 8]


def validation_set(run: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Every validation sample of the run's data (179 digits images: the held-out inputs of the parity gate)."""
    cfg = load_config(run / "config.toml", validate=False)
    val = build_data(cfg.data, cfg.model).val
    return val.fetch(torch.arange(len(val)))


def test_dynamic_onnx_matches_eager_on_any_batch(onnx_dynamic, eager, mlp_run):  # noqa: F811
    out, report = onnx_dynamic
    p = report.parity
    assert (p.source, p.samples) == ("validation", 179)
    # the fp32 bound is 1e-4 times the largest eager logit on those inputs, or 1e-4 when every logit is below 1 (as
    # here: the scaled case is test_the_fp32_bound_scales_with_the_largest_logit)
    x, _ = validation_set(mlp_run)
    largest = float(eager(x).abs().max())
    assert len(x) == 179 and largest < 1.0, largest
    assert p.bound == 1e-4
    assert p.max_abs_diff <= 1e-5 and p.ok
    assert p.eager_acc == p.export_acc and p.agreement == 1.0
    assert ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).get_inputs()[0].shape[0] == "batch"
    module, meta = load_edge(out)
    assert module.batch is None and module.backend == "onnxruntime"
    for rows in (1, 7, 40):
        x = torch.randn(rows, 1, 8, 8, generator=torch.Generator().manual_seed(rows))
        assert float((module(x) - eager(x)).abs().max()) <= 1e-5


@pytest.mark.parametrize(("error", "ok"), [(1.9e-3, True), (2.1e-3, False)])
def test_the_fp32_bound_scales_with_the_largest_logit(error, ok):
    """Logits up to 20 in size: the bound is 1e-4 * 20 = 2e-3; an export off by 1.9e-3 passes, by 2.1e-3 fails."""
    x = torch.linspace(-1, 1, 64).reshape(16, 4)
    logits = lambda v: 20 * v  # noqa: E731
    p = compare(logits, lambda v: logits(v) + error, HeldOut(x, None, "random"),
                DataSpec("synthetic", "classification", [4], num_classes=4), quantized=False)
    assert p.bound == pytest.approx(2e-3, rel=1e-6)
    assert p.max_abs_diff == pytest.approx(error, abs=1e-6)  # float32 rounding of 20 + error
    assert p.ok is ok


def test_fixed_batch_runs_in_padded_chunks(mlp_run, eager, tmp_path):  # noqa: F811
    report = export_edge(mlp_run, tmp_path / "b4.onnx", batch=4)
    assert report.batch == "4" and report.parity.ok
    module, _ = load_edge(tmp_path / "b4.onnx")
    x = torch.randn(7, 1, 8, 8)  # two chunks of 4, the second padded with a zero row
    assert module.batch == 4 and float((module(x) - eager(x)).abs().max()) <= 1e-5


def test_int8_is_smaller_and_keeps_accuracy(mlp_run, tmp_path, onnx_dynamic):  # noqa: F811
    report = export_edge(mlp_run, tmp_path / "q.onnx", batch="dynamic", quantize="int8")
    p = report.parity
    assert report.format == "onnx-int8" and p.bound is None and p.ok
    assert report.size_bytes < report.fp32_size_bytes
    assert abs(report.fp32_size_bytes - onnx_dynamic[1].size_bytes) < 1024  # the fp32 file it quantized
    assert p.eager_acc - p.export_acc <= 0.05 and p.agreement >= 0.9 and p.export_loss - p.eager_loss <= 0.1
    assert 0 < p.max_abs_diff < 0.5  # int8 does change the logits a little
    assert "fp32 -> " in report.lines()[0] and " int8 (" in report.lines()[0]


def test_pt2_export_is_exact(mlp_run, eager, tmp_path):  # noqa: F811
    report = export_edge(mlp_run, tmp_path / "m.pt2", batch="dynamic")
    assert report.backend == "torch.export" and report.parity.max_abs_diff <= 1e-6
    module, meta = load_edge(tmp_path / "m.pt2")
    x = torch.randn(5, 1, 8, 8)
    assert meta["plait.format"] == "pt2" and float((module(x) - eager(x)).abs().max()) <= 1e-6


def test_gpt_exports_with_any_prompt_length(gpt_run, tmp_path):  # noqa: F811
    report = export_edge(gpt_run, tmp_path / "g.onnx", batch="dynamic")
    assert report.parity.max_abs_diff <= 1e-4 and report.parity.agreement == 1.0
    module, meta = load_edge(tmp_path / "g.onnx")
    eager = load_model(ModelRef(str(gpt_run))).module
    ids = torch.randint(0, eager.head.out_features, (3, 5))
    assert "plait.tokenizer" in meta and float((module(ids) - eager(ids)).abs().max()) <= 1e-4


def test_a_missed_gate_writes_nothing(mlp_run, tmp_path, monkeypatch, capsys):  # noqa: F811
    monkeypatch.setattr("plait.edge.parity.FP32_ATOL", -1.0)  # no export can meet a negative bound
    assert main(["export", str(mlp_run), "-o", str(tmp_path / "x.pt2")]) == 2
    err = capsys.readouterr().err
    assert "the exported model does not match the eager one: parity on 179 validation inputs" in err
    assert list(tmp_path.iterdir()) == []


def test_the_gate_decides_on_the_numbers():
    assert Parity(10, "validation", 2e-5, 1e-4).ok and not Parity(10, "validation", 2e-4, 1e-4).ok
    int8 = dict(samples=10, source="validation", max_abs_diff=0.3, bound=None)
    assert Parity(**int8, eager_acc=0.90, export_acc=0.86, eager_loss=0.5, export_loss=0.55).ok
    assert not Parity(**int8, eager_acc=0.90, export_acc=0.84).ok  # accuracy drop 0.06 > 0.05
    assert not Parity(**int8, eager_loss=0.5, export_loss=0.65).ok  # loss increase 0.15 > 0.1
    assert not Parity(**{**int8, "source": "random"}, agreement=0.85).ok  # no labels: top-1 agreement < 0.9


@pytest.mark.parametrize("args, message", [
    (["--batch", "0"], "--batch '0' must be 'dynamic' or a positive integer (the fixed batch size)"),
    (["-o", "m.pt2", "--quantize", "int8"], "--quantize int8 is for .onnx exports (onnxruntime's quantization)"),
    (["--aoti"], "--aoti compiles a .pt2 with AOTInductor; -o m.onnx is .onnx"),
    (["-o", "m.safetensors", "--batch", "dynamic"], "--batch, --quantize and --aoti apply to edge exports"),
])
def test_bad_flags_exit_2_before_loading(tmp_path, capsys, args, message):
    argv = ["export", str(tmp_path / "no-such-run"), "-o", "m.onnx", *args]
    if "-o" in args:
        del argv[2:4]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_pte_is_refused_with_the_reason(mlp_run, capsys):  # noqa: F811
    try:  # ExecuTorch is not a plait extra (docs/serving.md)
        import executorch  # noqa: F401
        pytest.skip("ExecuTorch is installed here")
    except ImportError:
        pass
    assert main(["export", str(mlp_run), "-o", "m.pte"]) == 2
    assert "-o model.pte needs ExecuTorch, which is not installed" in capsys.readouterr().err


def test_served_metadata_comes_from_the_file(onnx_dynamic):
    served = load_model(ModelRef(str(onnx_dynamic[0])))
    assert (served.registry_name, served.backend, served.spec.num_classes) == ("mlp", "onnxruntime", 10)
    assert served.checkpoint.startswith("step") and not Path(served.checkpoint).suffix
    assert np.array_equal(served.module(torch.zeros(2, 1, 8, 8)).shape, (2, 10))
