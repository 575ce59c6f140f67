"""Shared test helpers: tiny configs and functions that the rank pool runs (module-level, picklable)."""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def eager():
    """torch.compile off inside, back on after (a later test in the same rank process compiles again): torchao's
    low-bit optimizers compile their step per parameter shape, about 15 s of a fresh rank, and eagerly the arithmetic
    is the same (tests/finetune/test_adamw8bit.py runs it so)."""
    from unittest import mock

    with mock.patch.object(torch, "compile", lambda fn=None, **_: fn):  # torchao asks fullgraph: dynamo's off switch errs
        yield


def eager_rank0_params(cfg, run_dir, resume: bool = False):
    """Pool task: rank0_params with torch.compile off (eager above)."""
    with eager():
        return rank0_params(cfg, run_dir, resume)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# ---- end-to-end runs through the command line (fault-tolerance and netns tests)

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1"}
ENV.pop("PLAIT_FAULTS", None)


def plait(*args, faults: str = "", timeout: float = 240, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """Run the plait CLI (optionally with PLAIT_FAULTS injected) as the `plait` script runs it, in a process forked from
    this pytest worker's warm server (start_cli), its output captured as subprocess.run(capture_output=True) would."""
    env = {**ENV, "PLAIT_FAULTS": faults} if faults else ENV
    argv = [str(a) for a in args]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, open(os.devnull, "rb") as null:
        proc = start_cli(argv, env, cwd or os.getcwd(), {0: null.fileno(), 1: out.fileno(), 2: err.fileno()})
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(["plait", *argv], timeout)
        text = []
        for f in (out, err):
            f.seek(0)
            text.append(f.read().decode(errors="replace"))
    return subprocess.CompletedProcess(["plait", *argv], proc.exitcode, *text)


_PORTS_GIVEN: set[int] = set()
# the ports the suite's own processes choose: below 15000, where the Slurm launcher derives its rendezvous port
# (15000 + job id % 10000) and the MPI one its own (20000-29999); below the Ray fixture's worker ports (30000-32000)
# and the kernel's ephemeral range; above Ray's client server (10001)
PORT_RANGE = (10002, 15000)


def free_port() -> int:
    """A free loopback port in PORT_RANGE, not handed out before in this process. A port from bind(0) is an ephemeral
    one, free again once the probe closes it: two jobs started back to back once had the second job's port taken
    meanwhile by a listener of the first (tensorpipe's, on an ephemeral port), and a store client of the second job
    talking to it crashed a rank of the first (std::bad_alloc in init_rpc). A port anywhere below the ephemeral range
    once fell in the Ray head's worker ports (30000-32000) and `ray start` refused it."""
    import random

    for _ in range(200):
        port = random.randrange(*PORT_RANGE)
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {PORT_RANGE[0]}-{PORT_RANGE[1] - 1}")


def start_ranks(run: Path, world: int, *args: str, env: dict | None = None) -> list[ForkedRank]:
    """Every rank of RUN's job as `python -m plait.worker RUN [args]` would run it, on one free loopback port, without
    torchrun's agent (which ends the whole job when one process dies): what a parameter-server test starts by hand.
    Each is forked from this pytest worker's warm server (plait.testing: torch and the trainer imported once), not a
    new interpreter importing them again (~3 s of CPU a rank)."""
    from plait.testing import _warm_default, _WarmProcess

    port = free_port()
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


def _leave_server(env: dict) -> None:
    """In a process forked from the warm server: env as its whole environment, and the server's "clients alive" pipe
    closed (a process holding it would keep the server up)."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    os.environ.clear()
    os.environ.update(env)


def _forked_worker(argv: list[str], env: dict, log: str) -> None:
    """In the forked rank: `python -m plait.worker ARGV` with env as its whole environment, stdout and stderr to log."""
    _leave_server(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for std in (1, 2):
        os.dup2(fd, std)
    os.close(fd)
    from plait.exiting import exit_now
    from plait.worker import main

    exit_now(main(argv))


def _forked_cli(argv: list[str], env: dict, cwd: str) -> None:
    """In the forked process: `plait ARGV` as the `plait` script runs it, in cwd, with env as its whole environment and
    the standard fds it was given (_WarmProcess set them)."""
    import multiprocessing
    from multiprocessing import process

    _leave_server(env)
    # multiprocessing as a new interpreter has it (a library's Pool relies on the default "fork"; this process is the
    # main one, with no parent), not as it set itself up in a forkserver's child
    multiprocessing.set_start_method(None, force=True)
    process._parent_process = None  # type: ignore[attr-defined]
    multiprocessing.current_process().name = "MainProcess"
    os.chdir(cwd)
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # multiprocessing left sys.stdin on /dev/null
    sys.argv = [str(Path(sys.executable).parent / "plait"), *argv]
    from plait.cli import run

    run()


def start_cli(argv: list[str], env: dict, cwd: str | Path, std: dict[int, int]):
    """`plait ARGV` in cwd with env, forked from this pytest worker's warm server (torch and plait imported once: a new
    interpreter spends 1.5-2 s of CPU importing them); std: its fds 0, 1 and 2 -> fds of this process to copy. The
    started process (multiprocessing's: join, exitcode, kill); a negative exitcode is the signal that ended it."""
    from plait.testing import _warm_default, _WarmProcess

    proc = _WarmProcess(warm=_warm_default() or (), std=std, target=_forked_cli, args=(list(argv), env, str(cwd)))
    proc.start()
    return proc


class WarmCLI:
    """`plait ARGS` for clients that connect to a unix socket (the docs' shell scripts, tests/test_docs_run.py), each run by
    start_cli. A client sends one byte with its fds 0, 1 and 2, then a 4-byte big-endian length and a JSON object
    {"argv", "cwd", "env"}; it gets back the exit status (4 bytes: 128 + N for a process ended by signal N). A client
    that hangs up first (killed) has its process killed."""

    def __init__(self, folder: Path):
        import threading

        self.path = str(folder / "plait-cli.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        self._sock.listen(8)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        import json
        from multiprocessing.connection import wait

        with conn:
            _, fds, _, _ = socket.recv_fds(conn, 1, 3)
            try:
                size = int.from_bytes(_recv_exactly(conn, 4), "big")
                ask = json.loads(_recv_exactly(conn, size))
                proc = start_cli(ask["argv"], ask["env"], ask["cwd"], dict(zip((0, 1, 2), fds)))
            finally:
                for fd in fds:  # the child has its own copies
                    os.close(fd)
            wait([proc.sentinel, conn])
            if proc.exitcode is None:  # the client hung up: it was killed
                proc.kill()
            proc.join()
            code = proc.exitcode
            try:
                conn.sendall((code if code >= 0 else 128 - code).to_bytes(4, "big"))
            except OSError:
                pass

    def close(self) -> None:
        self._sock.close()


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        chunk = conn.recv(n - len(got))
        if not chunk:
            raise ConnectionError(f"the client hung up after {len(got)} of {n} bytes")
        got += chunk
    return got


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
