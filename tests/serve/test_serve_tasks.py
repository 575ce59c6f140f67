"""The typed seam between the service and its executors (plait.serve.executor.tasks): tasks, results and pipe messages
pickle, every executor satisfies the Executor protocol, and serve's modules import each other without a cycle."""

import ast
import inspect
import pickle
from pathlib import Path

import numpy as np
import pytest

import plait.serve
from plait.serve.executor.runner import LocalExecutor, Runner
from plait.serve.executor.tasks import (
    Cancel,
    Done,
    Executor,
    Failed,
    Generate,
    GenerateOutput,
    GenRow,
    Infer,
    InferOutput,
    LoadFailed,
    Ready,
    RowFailed,
    Submit,
    Token,
)
from plait.serve.fleet.pipeline import PipelineExecutor, StageFailed, StageReady
from plait.serve.fleet.replicas import ReplicaPool
from plait.serve.model.load import ModelRef, load_model
from serve_helpers import gpt_run, mlp_run  # noqa: F401

SERVE = Path(plait.serve.__file__).parent


def roundtrip(obj):
    return pickle.loads(pickle.dumps(obj))


def test_tasks_results_and_messages_cross_a_pipe():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    task = roundtrip(Submit(7, Infer(x)))
    assert task.task_id == 7 and isinstance(task.task, Infer) and np.array_equal(task.task.inputs, x)
    rows = (GenRow([1, 2], 5, 0.5, 3, 11), GenRow([4], 1))
    assert roundtrip(Submit(8, Generate(rows))) == Submit(8, Generate(rows))
    done = roundtrip(Done(7, InferOutput({"logits": x})))
    assert np.array_equal(done.result.outputs["logits"], x)
    tokens = GenerateOutput([[3, 4], RowFailed("ValueError: bad")])
    assert roundtrip(Done(8, tokens)).result == tokens
    for msg in (Cancel(8, (0, 1)), Ready(123, {"process_s": 0.1, "imports_s": 1.0, "load_s": 0.2}),
                LoadFailed("Traceback ..."), Token(8, 1, 0, 42), Failed(8, "RuntimeError: x"),
                StageReady(1, 99, (1, 2)), StageFailed(0, "Traceback ...")):
        assert roundtrip(msg) == msg


def test_a_batch_is_merged_into_one_task_of_its_type():
    a, b = np.zeros((2, 3), np.float32), np.ones((1, 3), np.float32)
    one = Infer(a)
    assert Infer.merge([one]) is one
    merged = Infer.merge([Infer(a), Infer(b)])
    assert merged.inputs.shape == (3, 3) and merged.inputs[:, 0].tolist() == [0.0, 0.0, 1.0]
    r1, r2 = GenRow([1], 2), GenRow([2], 3)
    assert Generate.merge([Generate((r1,)), Generate((r2,))]) == Generate((r1, r2))
    assert (Infer.kind, Generate.kind) == ("infer", "generate")  # what ReplicaPool.running() reports


PROTOCOL_RUN = inspect.signature(Executor.run)


def satisfies(executor) -> None:
    assert isinstance(executor, Executor)
    assert isinstance(executor.capacity, int) and executor.capacity >= 1 and executor.restarts == 0
    for name in ("start", "stop", "run"):
        assert inspect.iscoroutinefunction(getattr(executor, name)), name
    assert not inspect.iscoroutinefunction(executor.ready)
    assert list(inspect.signature(type(executor).run).parameters) == list(PROTOCOL_RUN.parameters)


def test_every_executor_satisfies_the_protocol(mlp_run, gpt_run):  # noqa: F811
    served = load_model(ModelRef(str(mlp_run / "model.safetensors")))
    satisfies(LocalExecutor(Runner(served)))
    satisfies(ReplicaPool(ModelRef(str(mlp_run / "model.safetensors")), 2, None))  # nothing spawned before start()
    gpt = ModelRef(str(gpt_run / "model.safetensors"))
    pipeline = PipelineExecutor(gpt, load_model(gpt), 2)
    satisfies(pipeline)
    assert pipeline.capacity == 2


def test_the_runner_dispatches_on_the_task_type(mlp_run):  # noqa: F811
    runner = Runner(load_model(ModelRef(str(mlp_run / "model.safetensors"))), pad_to=4)
    x = np.zeros((3, 1, 8, 8), np.float32)
    out = runner.run(Infer(x))
    assert isinstance(out, InferOutput) and out.outputs["logits"].shape == (3, 10)
    assert out.outputs["label"].shape == (3,)
    with pytest.raises(TypeError, match=r"^not a serving task: tuple \(see plait.serve.executor.tasks\)$"):
        runner.run(("infer", x))


def _plait_imports(path: Path) -> list[tuple[str, int, bool, str]]:
    """(module imported, line, inside a function, the line's text) for each plait import in `path`."""
    source = path.read_text()
    lines, out = source.splitlines(), []

    def visit(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom) and child.module and child.module.startswith("plait"):
                out.append((child.module, child.lineno, in_function, lines[child.lineno - 1]))
            elif isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, in_function, lines[child.lineno - 1])
                           for a in child.names if a.name.startswith("plait"))
            visit(child, inner)

    visit(ast.parse(source), False)
    return out


def _serve_name(path: Path) -> str:
    rel = path.relative_to(SERVE).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def test_serve_modules_import_each_other_without_a_cycle():
    files = sorted(SERVE.rglob("*.py"))
    graph = {_serve_name(p): {m.removeprefix("plait.serve.") for m, *_ in _plait_imports(p)
                              if m.startswith("plait.serve.")} for p in files}
    assert "fleet.replicas" not in graph["fleet.coldstart"] | graph["fleet.replica_worker"]
    assert "fleet.coldstart" in graph["fleet.replicas"]
    done: set[str] = set()

    def walk(node: str, path: tuple[str, ...]) -> None:
        assert node not in path, " -> ".join((*path, node))
        if node not in done:
            for nxt in sorted(graph.get(node, ())):
                walk(nxt, (*path, node))
            done.add(node)

    for module in sorted(graph):
        walk(module, ())
    lazy = [(p.name, line, text.strip()) for p in files for _, line, inside, text in _plait_imports(p)
            if inside and "#" not in text]
    assert lazy == []  # each import kept inside a function says why on its line (start-up time, a dependency)


def test_serving_imports_no_dtensor():
    """Issue 57 item 5: `plait serve` was 15.7 s to ready, 2.6 s of it torch.distributed.tensor (LoRA's tp styles,
    imported through the export path); serving a model in one process imports none of it."""
    import subprocess
    import sys

    code = ("import sys, plait.serve.entrypoints.server, plait.serve.model.load, plait.serve.cli; "
            "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.tensor'))[:3])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
