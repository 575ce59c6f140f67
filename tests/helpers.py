"""Shared test helpers: tiny configs and functions that the rank pool runs (module-level, picklable)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from plait.config import load_config

# optim.eps = 1e-6: with AdamW's default 1e-8, gradient entries that are zero up to rounding (~1e-10)
# get updates of lr * g / (|g| + eps) ~ 1e-2 * lr whose sign is the rounding's; a larger eps keeps
# that amplified noise below the 1e-5 the layout-independence contract is checked at.
TINY_GPT = [
    "model.layers=2", "model.width=32", "model.heads=2", "model.context=32",
    "train.global_batch_size=8", "train.micro_batch_size=4", "train.eval_samples=16", "train.eval_batch_size=4",
    "train.sample_tokens=0", "optim.warmup_steps=3", "optim.lr=3e-3", "optim.eps=1e-6",
    "log.progress=false", "log.report=false", "log.every=1",
    "data.min_char_count=1", "checkpoint.every=5", "checkpoint.keep=3",
]


def tiny_gpt_config(corpus: Path, *overrides: str):
    return load_config(None, TINY_GPT + ["data.name='text'", f"data.path='{corpus}'", *overrides])


def params_after(cfg, run_dir, resume: bool = False) -> dict[str, torch.Tensor]:
    """Train as configured in this process (or on this rank); the plain model's parameters, on CPU."""
    from plait.train.trainer import train

    result = train(cfg, run_dir, resume=resume)
    return result.strategy.full_model_state_dict()


def rank0_params(cfg, run_dir, resume: bool = False):
    """Pool task: train on every rank, return rank 0's parameters (None elsewhere)."""
    import torch.distributed as dist

    params = params_after(cfg, run_dir, resume)
    return params if dist.get_rank() == 0 else None


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# ---- end-to-end runs through the command line (fault-tolerance and netns tests)

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1"}
ENV.pop("PLAIT_FAULTS", None)


def plait(*args, faults: str = "", timeout: float = 240, **popen) -> subprocess.CompletedProcess:
    """Run the plait CLI in a subprocess (optionally with PLAIT_FAULTS injected)."""
    env = {**ENV, "PLAIT_FAULTS": faults} if faults else ENV
    return subprocess.run([sys.executable, "-m", "plait", *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=timeout, **popen)


def start_ranks(run: Path, world: int, *args: str, env: dict | None = None) -> list[ForkedRank]:
    """Every rank of RUN's job as `python -m plait.worker RUN [args]` would run it, on one free loopback port, without
    torchrun's agent (which ends the whole job when one process dies): what a parameter-server test starts by hand.
    Each is forked from this pytest worker's warm server (plait.testing: torch and the trainer imported once), not a
    new interpreter importing them again (~3 s of CPU a rank)."""
    from plait.testing import _warm_default, _WarmProcess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logs = Path(tempfile.mkdtemp(prefix="ranks-"))
    ranks = []
    for r in range(world):
        rank_env = {**ENV, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port), **(env or {})}
        log = logs / f"rank{r}.log"
        proc = _WarmProcess(warm=_warm_default() or (), target=_forked_worker,
                            args=([str(run), *args], rank_env, str(log)), daemon=True)
        proc.start()
        ranks.append(ForkedRank(proc, log))
    return ranks


def _forked_worker(argv: list[str], env: dict, log: str) -> None:
    """In the forked rank: `python -m plait.worker ARGV` with env as its whole environment, stdout and stderr to log."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # the server's "clients alive" pipe: a rank holding it would keep the server up
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for std in (1, 2):
        os.dup2(fd, std)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    from plait.exiting import exit_now
    from plait.worker import main

    exit_now(main(argv))


class ForkedRank:
    """A forked rank with what finish_ranks uses of a Popen: communicate (its output, merged), poll, kill, wait."""

    def __init__(self, proc, log: Path):
        self.proc, self.log = proc, log

    @property
    def returncode(self) -> int | None:
        return self.proc.exitcode

    def poll(self) -> int | None:
        return self.proc.exitcode

    def wait(self, timeout: float | None = None) -> int | None:
        self.proc.join(timeout)
        return self.proc.exitcode

    def kill(self) -> None:
        self.proc.kill()

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        if self.wait(timeout) is None:
            raise subprocess.TimeoutExpired(f"rank {self.proc.pid}", timeout)
        return self.log.read_text(errors="replace") if self.log.exists() else "", None


def finish_ranks(procs: list[ForkedRank], timeout: float) -> tuple[list[int], list[str]]:
    """Wait for started ranks: their exit codes and outputs in rank order; any left running is killed."""
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs], outs


def weights(run: Path) -> dict:
    """Export a run and load its weights. The export runs in this process, as `plait export` runs it (plait.api.export,
    which the CLI calls): a `plait export` subprocess costs ~2 s of interpreter and torch start-up per call, and the
    fault-tolerance tests call this after every run (the CLI itself is tested in tests/export and tests/test_cli.py)."""
    from safetensors.torch import load_file

    from plait.api import export

    return load_file(str(export(run, run / "model.safetensors")))


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (torchrun's workers run in sessions of their own)."""
    children = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    children.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return [pid] + [p for c in children for p in process_tree(c)]


def reset_compiler() -> None:
    """Forget what torch.compile compiled earlier in this (long-lived) process: its guards would make a new model
    recompile against every earlier one, seconds of work that a fresh run does not pay."""
    import torch._dynamo

    torch._dynamo.reset()


def step_losses(run: Path) -> list[tuple[float, float]]:
    """(loss, grad norm) of every logged step of a run, in order (metrics.jsonl)."""
    import json

    return [(m["loss"], m["grad_norm"]) for m in map(json.loads, (Path(run) / "metrics.jsonl").read_text().splitlines())
            if "loss" in m]


# tensor-parallel layouts of the tiny GPT: name -> (processes, overrides)
TP_LAYOUTS = {
    "tp2": (2, ("parallel.dp=1", "parallel.tp=2")),
    "dp2xtp2": (4, ("parallel.dp=2", "parallel.tp=2", "train.micro_batch_size=2")),
    "pp2xtp2": (4, ("parallel.dp=1", "parallel.pp=2", "parallel.tp=2")),
}

# plain SGD for layout-equivalence tests: no momentum, decay, clipping, warm-up or schedule hiding a gradient's scale
PLAIN_SGD = ["checkpoint.every=0", "optim.name=sgd", "optim.momentum=0", "optim.weight_decay=0", "optim.grad_clip=0",
             "optim.warmup_steps=0", "optim.lr=0.5", "optim.schedule=constant"]


def one_process_runs(corpus: Path, root: Path, *base: str):
    """get(*more): the tiny GPT's one-process run of base + more, (final weights, step_losses), each computed once."""
    cache: dict = {}

    def get(*more: str):
        if more not in cache:
            run = root / f"one-{len(cache)}"
            cache[more] = params_after(tiny_gpt_config(corpus, "parallel.dp=1", *base, *more), run), step_losses(run)
        return cache[more]

    return get


def assert_follows(ref: tuple[dict, list], got: dict, run: Path, steps: int, rel: float, atol: float) -> None:
    """The run's per-step loss and grad norm within rel of the reference's, its final weights within atol."""
    weights, losses = ref
    mine = step_losses(run)
    assert len(mine) == len(losses) == steps
    for (l1, g1), (l2, g2) in zip(losses, mine):
        assert l2 == pytest.approx(l1, rel=rel) and g2 == pytest.approx(g1, rel=rel)
    assert got.keys() == weights.keys()
    assert max((weights[k] - got[k]).abs().max().item() for k in weights) < atol
