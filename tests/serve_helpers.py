"""Shared by the tests/test_serve*.py files: tiny trained runs (built once per session) and HTTP helpers."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from helpers import TINY_GPT
from plait.config import load_config

_RUNS: dict[str, Path] = {}
_LOCK = threading.Lock()
COMMON = ["parallel.dp=1", "log.progress=false", "log.report=false", "checkpoint.every=0", "optim.warmup_steps=2"]


def trained_run(kind: str, root: Path, corpus: Path | None = None) -> Path:
    """Train and export a tiny run of `kind` once per test session; returns its run dir (model.safetensors inside)."""
    from plait.export import export
    from plait.train.trainer import train

    with _LOCK:
        if kind not in _RUNS:
            run = root / kind
            if kind == "gpt":
                # Almost untrained, with its own head: greedy continuations vary from token to token, so equal
                # tokens mean something (a tied GPT trained for seconds continues every prompt with spaces).
                cfg = load_config(None, TINY_GPT + COMMON + ["data.name='text'", f"data.path='{corpus}'",
                                                             "train.steps=2", "optim.lr=1e-5", "model.tie_embeddings=false"])
            else:
                cfg = load_config(None, COMMON + [f"model.name={kind}", "data.name=digits", "model.width=16",
                                                  "train.steps=12" if kind == "mlp" else "train.steps=4",
                                                  "train.global_batch_size=32", "train.micro_batch_size=32",
                                                  "train.eval_samples=64"])
            train(cfg, run)
            export(run)
            _RUNS[kind] = run
        return _RUNS[kind]


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory) -> Path:
    return trained_run("mlp", tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def cnn_run(tmp_path_factory) -> Path:
    return trained_run("cnn", tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory, tiny_text) -> Path:
    return trained_run("gpt", tmp_path_factory.getbasetemp(), tiny_text)


def infer_json(x, name: str = "input", datatype: str = "FP32") -> dict:
    return {"inputs": [{"name": name, "shape": list(x.shape), "datatype": datatype, "data": x.reshape(-1).tolist()}]}


async def gather_posts(url: str, bodies: list[dict], timeout: float = 60.0) -> list[httpx.Response]:
    """POST every body at once (one connection each), answers in order."""
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=len(bodies))) as client:
        return list(await asyncio.gather(*(client.post(url, json=b) for b in bodies)))


def poll(predicate, timeout_s: float = 30.0, what: str = "condition"):
    """Wait until predicate() is truthy (checked every 10 ms); fail the test after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        threading.Event().wait(0.01)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def kill_tree(proc: subprocess.Popen) -> None:
    """Last-resort cleanup for a server subprocess and its workers."""
    for pid in children_of(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)
