r"""One GPU, one short session: training speed and MFU, mixed precision, ZeRO-3, resume and serving, in one run.

plait's tests run on CPU with gloo. This script is what a rare GPU session (one NVIDIA H200, about
15 minutes of device time in all) runs, so that those minutes go to measuring, not debugging.
`--device cpu --tiny` runs the same code paths on CPU in about 35 s (tests/test_gpu_check.py runs it
in `make test`).

    python benchmarks/gpu_check.py --device cuda [--parts train_large,serve] [--timeout-s 420] [--out FILE.json]
    python benchmarks/gpu_check.py --device cpu --tiny --out /tmp/gpu_check.json

Every part goes through plait's own entry points: a Config from plait.train.job.load_job, then
plait.train.trainer.train in this process (world size 1: NCCL on the GPU, gloo on CPU), `plait export`
(plait.cli.main) and `plait serve` (a child process, loaded by plait.bench.serve's load generator).

Parts (--parts; default all, run in this order, each in a child process of its own):

  train_default  the default GPT (`plait train`'s built-in job with dp = 1: 0.8 M parameters, sequence 128,
                 global batch 32 in micro-batches of 16), bf16 autocast, torch.compile, 40 steps
  numerics       the default GPT for 10 steps in fp32, bf16 autocast and fp16 with loss scaling on the device,
                 each against the same job on CPU in fp32 (loss per step); fp16: checkpoint at step 5 -> load ->
                 resume to step 10, against the uninterrupted fp16 run
  zero3          ZeRO-3 on a 1-rank mesh (below), fp32 and bf16 (FSDP2's mixed precision) against CPU fp32;
                 checkpoint of the sharded (DTensor) state -> load -> resume, against the uninterrupted run
  train_large    a 1.0 B-parameter GPT (20 blocks, width 2048, 16 heads, sequence 2048; global batch 32
                 sequences in micro-batches of 8; --large-set changes it), bf16 autocast, torch.compile, 30
                 steps; activation checkpointing only if a step runs out of memory without it (the part then
                 retries with it and says so)
  train_llama    plait's llama at ~1.0 B parameters (TinyLlama's shape: 22 blocks, width 2048, 32 query heads over
                 4 kv heads, SwiGLU width 5632, sequence 2048; global batch 32 in micro-batches of 8), as
                 train_large (bf16 autocast, torch.compile, 30 steps, activation checkpointing only on OOM)
  serve          the large GPT: 1 training step, `plait export`, `plait serve` with batching off and on (at most
                 16 rows, 5 ms): requests/s at concurrency 1 and 16, the batching gain at 16, and /v1/generate
                 tokens/s at concurrency 1 and 16 (prompt + new tokens stay within the context: the KV cache is
                 used throughout). The servers run with `plait serve --device cuda` on a GPU (--device cpu
                 with --device cpu).

Training figures: tokens/s and step time over the logging windows after step 10 and before the last
one (whose last step also measures memory); peak memory = torch.cuda.max_memory_allocated; MFU =
achieved FLOP/s / the device's dense bf16 peak, with the PaLM paper's (appendix B) FLOPs per token
6 N + 12 L H Q T (N: every parameter, the tied embedding once since it is the output head's matmul; L
blocks, H heads, Q head width, T sequence length; activation checkpointing's recomputation is not
counted). Peaks: PEAK_BF16 below, by device name (989 TFLOP/s for H100/H200 SXM); a GPU not in the table
gets a measured bf16 matmul rate and a CPU a measured fp32 matmul rate, each labelled so. Target: MFU >=
45 % on the large GPT (reported as PASS/MISS; it does not fail the part).

Syncs: on the GPU, torch.cuda.set_sync_debug_mode("warn") is on from the start to the end of each
non-logging step after the warm-up, and its warnings are counted, with the file:line that caused each
(a deliberate .item() is counted first, to prove that the counter counts). The check passes at 0 per
step. On CPU the count is not applicable (null). Peak memory on CPU is the process's peak RSS
(ru_maxrss): an upper bound that includes Python, torch and the data.

Tolerances (TOLERANCES; max |loss difference| over the steps): fp32 2e-4 (the device's kernels reduce in
another order than the CPU's), bf16 2e-2, fp16 1e-2, ZeRO-3 bf16 2e-2; resume 1e-3 against the uninterrupted
run on the same device (attention backward kernels accumulate in a nondeterministic order on a GPU; on
CPU resume is bitwise, which the test asserts). The same 10 steps on CPU differ from fp32 by 1.0e-3
(bf16 autocast), 7e-4 (fp16) and 2.1e-3 (ZeRO-3 bf16): the tolerances leave about 10x for the GPU's kernels.

ZeRO-3 with dp = 1: plait's config refuses parallel.zero with dp = 1 (nothing to shard over), so the
zero3 part builds its model through `model.factory = "gpu_check:fsdp_gpt"`: plait's GPT from the
registry, sharded by plait.parallel.fsdp.apply_fsdp (stage 3) on a 1-rank device mesh. train() runs its
usual loop over it: FSDP2's all-gathers and reduce-scatters run (a 1-rank NCCL communicator on the GPU),
the gradient norm is taken over DTensor gradients and checkpoints hold DTensor state, as in a dp > 1
ZeRO-3 run. Not exercised: FSDPStrategy's no_sync (accumulation) and fp16 overflow all-reduce, which
need dp > 1.

--tiny shrinks everything: GPTs of 0.1 and 0.4 M parameters on a corpus of ten stdlib modules, 6-12
steps, serving at concurrency 2 with 16 new tokens. It leaves torch.compile off (inductor's CPU code
generation alone takes ~15 s on 2 cores; compile through train() is tested in tests/train/test_trainer.py)
and asserts that batches form (mean rows per batch > 1) rather than a throughput gain, which a
0.4 M-parameter model cannot show over HTTP on 2 loaded cores.

Failures: a part that raises, times out or fails a check is recorded (status, error, its log's tail)
and the others still run. The JSON is rewritten after each part, so a command killed at its limit keeps
what finished. --timeout-s is the budget of the whole run (a part that cannot start with 20 s left is
skipped; each part also has a limit of its own, PART_LIMIT_S). A second try runs only what is missing:
`--previous OLD.json` copies the parts that passed there.

The GPU command. The device machine has no network. Its image has torch (2.11, CUDA 13) under `python3`
but not FastAPI, uvicorn, pydantic or tomli-w; a CUDA torch wheel (~1 GB) cannot travel (64 MiB), and a
venv made there would not see the image's torch (which lives in another venv). So nothing is installed
from a torch wheel: plait runs from src/ on PYTHONPATH and the missing pure-Python packages travel as
wheels. Once, here (`.venv-*/` is git-ignored):

    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .venv-gpu/wheels fastapi==0.165.0 starlette==1.10.0 \
      pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
      annotated-doc==0.0.7 uvicorn==0.54.0 tomli-w==1.2.0 typing-extensions==4.16.0 opentelemetry-api==1.45.2

Then the device tool's `run` with carry [".venv-gpu"] and timeout_s 480, this command:

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .venv-gpu/wheels/*.whl \
      || exit 1; export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1; nvidia-smi -L; \
      python3 benchmarks/gpu_check.py --device cuda --timeout-s 420 --out $OUT/gpu_check.json

About 7.5 minutes are expected (train_default ~1, numerics and zero3 ~0.7 each, train_large and
train_llama ~2.5 each): past a 420 s budget the last parts are skipped, and a second try with
`--previous` runs only those, in the 15 minutes. It prints the table and leaves gpu_check.json and one
gpu_check_<part>.log per part in $OUT (7 files: the device tool brings back 8). For a second try,
copy the returned gpu_check.json to .venv-gpu/previous.json and add `--previous .venv-gpu/previous.json`
(and e.g. `--large-set train.micro_batch_size=4` to change the large job).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path

# The order they run in: the quick ones first, so that a slow large run cannot starve them of the budget.
PARTS = ("train_default", "numerics", "zero3", "train_large", "train_llama", "serve")
# Seconds a part may take at most (the --timeout-s budget may leave it less). Expected on an H200: train_default
# ~1 min (compile), numerics and zero3 ~40 s each, train_large ~2.5 min (1 B parameters initialised on CPU, compile,
# 30 steps of ~1 s), serve seconds (it stops at once while plait serve has no GPU path).
PART_LIMIT_S = {"train_default": 120, "numerics": 120, "zero3": 120, "train_large": 330, "train_llama": 330, "serve": 240}
TINY_PART_LIMIT_S = 90
MIN_START_S = {"gpu": 20.0, "tiny": 3.0}  # a part is skipped when less than this is left of the budget

# Dense bf16 tensor-core peaks (datasheets), matched in order against torch.cuda.get_device_name().
PEAK_BF16 = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H200 NVL", 835e12),
    ("H100", 989e12),  # SXM: "NVIDIA H100 80GB HBM3"
    ("H200", 989e12),  # SXM: "NVIDIA H200"
    ("GH200", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
)
MFU_TARGET = 0.45  # on the large GPT
TOLERANCES = {"fp32": 2e-4, "bf16": 2e-2, "fp16": 1e-2, "resume": 1e-3}  # max |loss difference| per step
SYNC_WARNING = "synchronizing CUDA operation"

# model and batch of each GPT; "default" on the GPU is plait's built-in job as it is.
SIZES = {
    "gpu": {
        "default": {},
        "large": {"model.width": 2048, "model.layers": 20, "model.heads": 16, "model.context": 2048,
                  "train.global_batch_size": 32, "train.micro_batch_size": 8},
        "llama": {"model.name": "'llama'", "model.width": 2048, "model.layers": 22, "model.heads": 32,
                  "model.kv_heads": 4, "model.hidden": 5632, "model.context": 2048,
                  "train.global_batch_size": 32, "train.micro_batch_size": 8},
    },
    "tiny": {
        "default": {"model.width": 64, "model.layers": 2, "model.heads": 2, "model.context": 64,
                    "train.global_batch_size": 8, "train.micro_batch_size": 8},
        "large": {"model.width": 128, "model.layers": 2, "model.heads": 4, "model.context": 128,
                  "train.global_batch_size": 8, "train.micro_batch_size": 4},
        "llama": {"model.name": "'llama'", "model.width": 64, "model.layers": 2, "model.heads": 4, "model.kv_heads": 2,
                  "model.hidden": 128, "model.context": 64, "train.global_batch_size": 8, "train.micro_batch_size": 4},
    },
}
# (steps, log.every, warm-up steps left out of the speed and sync figures)
TRAIN_STEPS = {("gpu", "default"): (40, 5, 10), ("gpu", "large"): (30, 5, 10), ("gpu", "llama"): (30, 5, 10),
               ("tiny", "default"): (12, 3, 3), ("tiny", "large"): (12, 3, 3), ("tiny", "llama"): (12, 3, 3)}
NUMERIC_STEPS = {"gpu": (10, 5), "tiny": (6, 3)}  # steps, and the step a resumed run restarts after
SERVE = {"gpu": {"concurrency": 16, "new_tokens": 128, "prompt": "def main(argv):\n    ", "duration_s": 6.0,
                 "warmup_s": 1.5, "gen_duration_s": 10.0},
         "tiny": {"concurrency": 2, "new_tokens": 16, "prompt": "def main(argv):\n    ", "duration_s": 0.5,
                  "warmup_s": 0.15, "gen_duration_s": 0.5}}
# Files for --tiny's corpus (a folder: the text source splits it by file), as tests/conftest.py's tiny_text.
TINY_CORPUS = ("textwrap.py", "string.py", "bisect.py", "heapq.py", "keyword.py", "colorsys.py", "fnmatch.py",
               "shlex.py", "glob.py", "copy.py")


class CheckFailed(Exception):
    """A part could not do what it is for (named in the message); recorded as its error."""


# =============================================================================== the parent: run parts, print, write


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="shrink everything (CPU: under a minute)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--timeout-s", type=float, default=None, help="budget for the whole run (default 420; --tiny 120)")
    p.add_argument("--out", type=Path, default=Path("runs/gpu_check.json"), help="the JSON (logs go beside it)")
    p.add_argument("--previous", type=Path, help="a JSON of an earlier run: its parts that passed are copied, not rerun")
    p.add_argument("--large-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override the large GPT's job (train_large and serve), e.g. train.micro_batch_size=4")
    p.add_argument("--workdir", type=Path, help="where run directories go (default: a temporary folder, removed)")
    p.add_argument("--_child", help=argparse.SUPPRESS)
    p.add_argument("--_result", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a._child:
        return child_main(a)
    parts = [s.strip() for s in a.parts.split(",") if s.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        p.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    timeout = a.timeout_s if a.timeout_s is not None else (120.0 if a.tiny else 420.0)
    return run_parts(a, [x for x in PARTS if x in parts], timeout)


def run_parts(a, parts: list[str], timeout_s: float) -> int:
    t0 = time.time()
    deadline = time.monotonic() + timeout_s
    out: Path = a.out
    out.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(a.previous.read_text()).get("parts", {}) if a.previous else {}
    workdir = a.workdir or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    workdir.mkdir(parents=True, exist_ok=True)
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "device": a.device, "tiny": a.tiny,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "timeout_s": timeout_s, "env": host_env(a.device),
        "tolerances": TOLERANCES, "mfu_target": MFU_TARGET, "parts": {}, "table": [],
    }
    scale = "tiny" if a.tiny else "gpu"
    print(f"[gpu_check] {a.device}{' --tiny' if a.tiny else ''}: parts {', '.join(parts)}; budget {timeout_s:.0f} s; "
          f"logs beside {out}", flush=True)
    for name in parts:
        if previous.get(name, {}).get("status") == "ok":
            report["parts"][name] = {**previous[name], "from_previous": str(a.previous)}
            print(f"[gpu_check] {name}: ok in {a.previous} (not rerun)", flush=True)
            continue
        left = deadline - time.monotonic()
        limit = min(left, TINY_PART_LIMIT_S if a.tiny else PART_LIMIT_S[name])
        log = out.with_name(f"{out.stem}_{name}.log")
        if left < MIN_START_S[scale]:
            result = {"status": "skipped", "error": f"{left:.0f} s left of --timeout-s {timeout_s:g}", "rows": []}
        else:
            result = run_child(a, name, workdir, log, limit)
        report["parts"][name] = result
        line = f"[gpu_check] {name}: {result['status']}" + (f" in {result['seconds']:.1f} s" if "seconds" in result else "")
        if result.get("error"):
            line += f": {result['error']}"
        print(line, flush=True)
        if result["status"] in ("error", "timeout") and log.exists():
            tail = log.read_text(errors="replace").splitlines()[-25:]
            print("\n".join("    | " + s for s in tail), flush=True)
        for key, value in result.get("env", {}).items():  # what only a child sees (torch imported, device initialised)
            if key in ("torch", "device_name") or key not in report["env"]:
                report["env"][key] = value
        report["wall_s"] = time.time() - t0
        report["table"] = table_rows(report["parts"])
        write_json(out, report)
    if a.workdir is None:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    report["wall_s"] = time.time() - t0
    report["table"] = table_rows(report["parts"])
    report["ok"] = all(report["parts"].get(n, {}).get("status") == "ok" for n in parts)
    write_json(out, report)
    print()
    print(format_table(report))
    print(f"\n{'all parts ok' if report['ok'] else 'NOT all parts ok'} · {report['wall_s']:.1f} s · wrote {out}", flush=True)
    return 0 if report["ok"] else 1


def run_child(a, name: str, workdir: Path, log: Path, limit: float) -> dict:
    """One part in a child process of its own (its own session: a timeout ends it and whatever it started)."""
    result_file = workdir / f"{name}.result.json"
    result_file.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--device", a.device, "--_child", name,
           "--_result", str(result_file), "--workdir", str(workdir)]
    cmd += ["--tiny"] if a.tiny else []
    for s in a.large_set:
        cmd += ["--large-set", s]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if a.device == "cpu":
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    t = time.monotonic()
    end = t + max(1.0, limit)
    rc = None
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        while rc is None and time.monotonic() < end:
            try:
                rc = proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                if result_file.exists():  # done; a child stuck in its shutdown gets 30 s more, not the whole limit
                    end = min(end, time.monotonic() + 30.0)
        seconds = time.monotonic() - t
        try:  # the child's own process group: a child past its limit, and whatever it left running
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    if result_file.exists():
        result = json.loads(result_file.read_text())
    elif rc is None:
        result = {"status": "timeout", "error": f"did not finish within {limit:.0f} s", "rows": []}
    else:
        result = {"status": "error", "error": f"the child process exited with {rc} before writing a result", "rows": []}
    result["seconds"] = seconds
    result["log"] = str(log)
    return result


def host_env(device: str) -> dict:
    """What this process sees without importing torch (the children add torch's own view) and nvidia-smi's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = None
    env = {"python": platform.python_version(), "torch": torch_version, "platform": platform.platform(),
           "cpus": os.cpu_count(), "plait_commit": _git_commit()}
    if device == "cuda":
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30)
            name, driver, memory = (s.strip() for s in q.stdout.splitlines()[0].split(","))
            env.update({"device_name": name, "driver": driver, "device_memory": memory})
        except (OSError, IndexError, ValueError, subprocess.SubprocessError) as e:
            env["driver"] = f"unknown (nvidia-smi: {type(e).__name__})"
    else:
        env["device_name"] = _cpu_name()
        env["driver"] = None
    return env


def _git_commit() -> str | None:
    try:
        q = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                           cwd=Path(__file__).resolve().parent)
        return q.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(path)


def table_rows(parts: dict) -> list[dict]:
    rows = []
    for name, result in parts.items():
        if not result.get("rows"):
            rows.append({"part": name, "item": "status", "value": result["status"], "target": "",
                         "ok": result["status"] == "ok", "kind": "check", "note": result.get("error") or ""})
        rows += [{"part": name, **r} for r in result.get("rows", [])]
        if result.get("rows") and result["status"] != "ok":
            rows.append({"part": name, "item": "status", "value": result["status"], "target": "", "ok": False,
                         "kind": "check", "note": result.get("error") or ""})
    return rows


def format_table(report: dict) -> str:
    env = report["env"]
    head = (f"plait gpu_check · {env.get('device_name')} · torch {env.get('torch')} · CUDA {env.get('cuda_runtime') or 'n/a'}"
            f" · driver {env.get('driver') or 'n/a'}" + (f" · NCCL {env['nccl']}" if env.get("nccl") else ""))
    lines = [head, f"{'part':<14} {'item':<62} {'value':>16}  {'target':<9} verdict", "-" * 120]
    for r in report["table"]:
        verdict = {True: "PASS", False: "FAIL", None: ""}[r.get("ok")]
        if r.get("kind") == "target" and r.get("ok") is False:
            verdict = "MISS"
        value = _fmt(r["value"]) + (f" {r['unit']}" if r.get("unit") else "")
        lines.append(f"{r['part']:<14} {r['item']:<62} {value:>16}  {str(r.get('target') or ''):<9} {verdict:<7}"
                     + (f"  ({r['note']})" if r.get("note") else ""))
    return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        if v == 0:
            return "0"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        if abs(v) >= 1:
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.1f}"
        return f"{v:.3g}"
    return str(v)


# =============================================================================== a child: one part


class Ctx:
    """What a part works with: the device, the scale, a work folder, the rows it reports."""

    def __init__(self, a):
        import torch

        self.a = a
        self.tiny = a.tiny
        self.scale = "tiny" if a.tiny else "gpu"
        self.device = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.workdir = Path(a.workdir) / a._child
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict] = []
        self.metrics: dict = {}
        self.corpus = make_corpus(Path(a.workdir) / "corpus") if a.tiny else None

    def row(self, item: str, value, unit: str = "", target="", ok: bool | None = None, kind: str = "info",
            note: str = "") -> None:
        if isinstance(value, float) and not math.isfinite(value):
            value = str(value)
        self.rows.append({"item": item, "value": value, "unit": unit, "target": target, "ok": ok, "kind": kind,
                          "note": note})

    def check(self, item: str, value, ok: bool, target="", unit: str = "", note: str = "") -> None:
        self.row(item, value, unit, target, bool(ok), "check", note)


def child_main(a) -> int:
    """Run one part; its result file is written before the process group is torn down (which could hang)."""
    result: dict = {"status": "error", "rows": [], "metrics": {}}
    ctx = None
    try:
        ctx = Ctx(a)
        result["env"] = device_env(ctx)
        init_process_group(ctx)
        PART_FUNCS[a._child](ctx)
        failed = [r["item"] for r in ctx.rows if r["kind"] == "check" and r["ok"] is False]
        result["status"] = "fail" if failed else "ok"
        if failed:
            result["error"] = "failed: " + "; ".join(failed)
    except BaseException as e:  # recorded, whatever it is: the parent goes on with the next part
        traceback.print_exc()
        text = str(e).strip().splitlines()
        result["status"] = "fail" if isinstance(e, CheckFailed) else "error"
        result["error"] = f"{type(e).__name__}: {text[0] if text else ''}"[:500]
    if ctx is not None:
        result["rows"], result["metrics"] = ctx.rows, ctx.metrics
    tmp = a._result.with_name(a._result.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.replace(a._result)
    sys.stdout.flush()
    end_process_group()
    return 0


def device_env(ctx: Ctx) -> dict:
    import torch

    env = {"torch": torch.__version__, "cuda_runtime": torch.version.cuda, "torch_threads": torch.get_num_threads()}
    if not ctx.cuda:
        return {**env, "device_name": _cpu_name()}
    props = torch.cuda.get_device_properties(ctx.device)
    env.update({"device_name": torch.cuda.get_device_name(ctx.device), "compute_capability": f"{props.major}.{props.minor}",
                "device_memory_bytes": props.total_memory})
    try:
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:  # noqa: BLE001 - a version string is nice to have, never a reason to fail
        env["nccl"] = f"unknown ({type(e).__name__})"
    return env


def init_process_group(ctx: Ctx) -> None:
    """World size 1 in this process: NCCL on the GPU, gloo on CPU; plait's runtime then takes it as it is."""
    import torch.distributed as dist

    kwargs = {"device_id": ctx.device} if ctx.cuda else {}
    dist.init_process_group("nccl" if ctx.cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1, **kwargs)


def end_process_group() -> None:
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the result is written; a failing teardown only goes to the log
        traceback.print_exc()


def make_corpus(folder: Path) -> Path:
    import sysconfig

    folder.mkdir(parents=True, exist_ok=True)
    root = Path(sysconfig.get_paths()["stdlib"])
    for name in TINY_CORPUS:
        target = folder / name
        if not target.exists():
            target.write_text((root / name).read_text())
    return folder


def job(ctx: Ctx, size: str, *extra: str):
    """plait's Config for one GPT of SIZES, on this device, without end-of-run extras (sample, evaluation)."""
    from plait.train.job import load_job

    over = ["parallel.dp=1", f"launch.device='{ctx.device.type}'", "log.progress=false", "log.report=false",
            "train.sample_tokens=0", "train.eval_samples=0", "checkpoint.every=0"]
    if ctx.tiny:
        over += ["data.name='text'", f"data.path='{ctx.corpus}'"]
    over += [f"{k}={v}" for k, v in SIZES[ctx.scale][size].items()]
    if size == "large":
        over += list(ctx.a.large_set)
    return load_job(None, [*over, *extra])


# ------------------------------------------------------------------------------- what train() shows us


class Probe:
    """Sees every metrics record train() writes and counts host-device syncs on non-logging steps.

    Installed as plait.train.trainer's Telemetry (a subclass: the loop and its telemetry are unchanged).
    """

    def __init__(self, ctx: Ctx):
        self.ctx = ctx
        self.records: list[dict] = []
        self.events: list[str] = []  # each sync warning: where it came from
        self.syncs: dict[int, list[str]] = {}
        self.warm = 0
        self.measuring = False
        self.selftest: bool | None = None
        if ctx.cuda:
            self._hook_warnings()

    def reset(self, warm: int) -> None:
        self.records, self.syncs, self.warm = [], {}, warm

    def install(self) -> None:
        import plait.train.build as trainer  # where the job builds its Telemetry

        probe, base = self, trainer.Telemetry

        class ProbedTelemetry(base):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                write = self.writer.write

                def capture(record: dict) -> None:
                    probe.records.append(dict(record))
                    write(record)

                self.writer.write = capture

            def begin(self, step: int) -> None:
                super().begin(step)
                probe.step_begins(self, step)

            def end(self, step, loss, grad_norm):
                try:
                    return super().end(step, loss, grad_norm)
                finally:
                    probe.step_ends(step)

        trainer.Telemetry = ProbedTelemetry

    def _hook_warnings(self) -> None:
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if SYNC_WARNING in str(message):
                self.events.append(f"{filename}:{lineno} [{threading.current_thread().name}]")
                return
            shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        warnings.filterwarnings("always", message=f".*{SYNC_WARNING}.*")

    def sync_selftest(self) -> bool:
        """A deliberate .item() under "warn" must be counted once, else the counts below mean nothing."""
        import torch

        x = torch.ones((), device=self.ctx.device)
        before = len(self.events)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            x.item()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        self.selftest = len(self.events) - before == 1
        return self.selftest

    def step_begins(self, tel, step: int) -> None:
        self.measuring = self.ctx.cuda and step > self.warm and not tel.logs(step)
        if self.measuring:
            import torch

            self.mark = len(self.events)
            torch.cuda.set_sync_debug_mode("warn")

    def step_ends(self, step: int) -> None:
        if self.measuring:
            import torch

            torch.cuda.set_sync_debug_mode("default")
            self.syncs[step] = self.events[self.mark:]
            self.measuring = False

    def losses(self) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in self.records if "loss" in r and "step_time_s" in r}

    def steady(self, stop: int, tokens_per_step: int) -> tuple[float, float, list[int]]:
        """tokens/s and step time over the logging windows after the warm-up and before the last one."""
        windows, prev = [], 0
        for r in sorted((r for r in self.records if "step_time_s" in r), key=lambda r: r["step"]):
            windows.append((prev, r["step"], r["step_time_s"]))
            prev = r["step"]
        chosen = [w for w in windows if w[0] >= self.warm and w[1] < stop] or windows[-1:]
        steps = sum(b - a for a, b, _ in chosen)
        seconds = sum((b - a) * t for a, b, t in chosen)
        return steps * tokens_per_step / seconds, seconds / steps, [chosen[0][0] + 1, chosen[-1][1]]


_PROBE: Probe | None = None


def probe_for(ctx: Ctx) -> Probe:
    global _PROBE
    if _PROBE is None:
        _PROBE = Probe(ctx)
        _PROBE.install()
    return _PROBE


def run_train(ctx: Ctx, cfg, run_dir: Path | None = None, resume: bool = False, warm: int = 0):
    """plait.train.trainer.train, watched by the probe; returns (TrainResult, per-step losses)."""
    from plait.train.trainer import train

    probe = probe_for(ctx)
    probe.reset(warm)
    result = train(cfg, run_dir, resume=resume)
    return result, probe.losses()


def peak_flops(ctx: Ctx) -> tuple[float, str]:
    import torch

    if ctx.cuda:
        name = torch.cuda.get_device_name(ctx.device)
        for key, value in PEAK_BF16:
            if key in name:
                return value, f"table: {key}, dense bf16"
        return measure_matmul(ctx.device, torch.bfloat16, 8192), f"measured: bf16 matmul ({name} is not in the table)"
    return measure_matmul(ctx.device, torch.float32, 512), f"measured: fp32 matmul, {torch.get_num_threads()} thread(s)"


def measure_matmul(device, dtype, n: int, repeats: int = 5) -> float:
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = math.inf
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def flops_per_token(n_params: int, layers: int, heads: int, head_dim: int, seq: int) -> int:
    """PaLM appendix B: 6 N + 12 L H Q T."""
    return 6 * n_params + 12 * layers * heads * head_dim * seq


# ------------------------------------------------------------------------------- parts


def part_train(ctx: Ctx, size: str) -> None:
    import gc

    import torch

    steps, every, warm = TRAIN_STEPS[(ctx.scale, size)]
    compile_on = not ctx.tiny
    base = [f"train.steps={steps}", f"log.every={every}", "precision.dtype='bf16'", f"train.compile={str(compile_on).lower()}"]
    probe = probe_for(ctx)
    if ctx.cuda:
        ok = probe.sync_selftest()
        ctx.check("sync counter counts a deliberate .item()", ok, ok)
    attempts = [[], ["train.activation_checkpointing=true"]] if ctx.cuda and size != "default" else [[]]
    note = ""
    for i, extra in enumerate(attempts):
        cfg = job(ctx, size, *base, *extra)
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats(ctx.device)
        try:
            result, losses = run_train(ctx, cfg, warm=warm)
            break
        except torch.cuda.OutOfMemoryError as e:
            if i == len(attempts) - 1:
                raise
            note = f"out of memory without activation checkpointing ({str(e).splitlines()[0][:120]}); retried with it"
            print(f"[gpu_check] {note}", flush=True)
        # outside the except block: the traceback (and the tensors its frames hold) is gone
        gc.collect()
        torch.cuda.empty_cache()
        torch._dynamo.reset()
    summary = result.summary
    m = cfg.model
    n_params, head_dim, seq = int(summary["params"]), m.width // m.heads, m.context
    tokens_per_step = cfg.train.global_batch_size * seq
    tok_s, step_s, span = probe.steady(steps, tokens_per_step)
    fpt = flops_per_token(n_params, m.layers, m.heads, head_dim, seq)
    peak, peak_source = peak_flops(ctx)
    mfu = fpt * tok_s / peak
    if ctx.cuda:
        mem, mem_kind = torch.cuda.max_memory_allocated(ctx.device), "torch.cuda.max_memory_allocated"
    else:
        mem, mem_kind = summary["memory"]["per_rank"][0]["peak_rss_bytes"], "peak RSS of the process (ru_maxrss), CPU"
    first, last = losses[min(losses)], losses[max(losses)]
    ctx.metrics.update({
        "params": n_params, "layers": m.layers, "heads": m.heads, "head_dim": head_dim, "width": m.width, "seq_len": seq,
        "global_batch": cfg.train.global_batch_size, "micro_batch": cfg.train.micro_batch_size,
        "tokens_per_step": tokens_per_step, "steps": steps, "log_every": every, "measured_steps": span,
        "tokens_per_s": tok_s, "step_time_s": step_s, "flops_per_token": fpt, "peak_flops": peak,
        "peak_flops_source": peak_source, "mfu": mfu, "peak_memory_bytes": mem, "peak_memory_kind": mem_kind,
        "precision": cfg.precision.dtype, "compile": cfg.train.compile,
        "activation_checkpointing": cfg.train.activation_checkpointing, "backend": summary.get("backend"),
        "device": summary.get("device"), "loss_first": first, "loss_last": last, "wall_time_s": summary["wall_time_s"],
    })
    desc = (f"{n_params / 1e6:.1f} M params, seq {seq}, batch {cfg.train.global_batch_size}x{cfg.train.micro_batch_size}"
            f"{', compile' if cfg.train.compile else ''}{', act. ckpt' if cfg.train.activation_checkpointing else ''}")
    ctx.row(f"model ({desc})", n_params, "params", note=note)
    ctx.row(f"tokens/s (steps {span[0]}-{span[1]})", tok_s, "tok/s")
    ctx.row("step time", step_s * 1000, "ms")
    ctx.row("peak memory", mem / 2**30, "GiB", note=mem_kind)
    targeted = size != "default" and ctx.cuda  # a CPU's measured matmul rate is no peak to hold a target against
    ctx.row("MFU (6N + 12LHQT) / peak", mfu * 100, "%", f">= {MFU_TARGET:.0%}" if targeted else "",
            (mfu >= MFU_TARGET) if targeted else None, "target" if targeted else "info",
            note=f"peak {peak / 1e12:.3g} TFLOP/s, {peak_source}")
    ctx.check("loss finite and lower after training", f"{first:.3f} -> {last:.3f}",
              math.isfinite(last) and last < first)
    if ctx.cuda:
        counts = [len(v) for v in probe.syncs.values()]
        per_step = max(counts) if counts else None
        sites = sorted({s for v in probe.syncs.values() for s in v})
        ctx.metrics.update({"syncs_per_non_logging_step": per_step, "sync_steps_measured": sorted(probe.syncs),
                            "sync_sites": sites[:20], "sync_selftest": probe.selftest})
        if probe.selftest and counts:
            ctx.check(f"syncs per non-logging step ({len(counts)} steps)", per_step, per_step == 0, "0",
                      note="; ".join(sites[:3]))
        else:
            ctx.row("syncs per non-logging step", None, note="not measured: " + (
                "the counter failed its self-test" if not probe.selftest else "no non-logging step after the warm-up"))
    else:
        ctx.metrics.update({"syncs_per_non_logging_step": None,
                            "syncs_note": "not applicable on CPU: there is no device to synchronise with"})
        ctx.row("syncs per non-logging step", None, note="n/a on CPU")


def _max_diff(a: dict[int, float], b: dict[int, float]) -> float:
    steps = sorted(set(a) & set(b))
    if not steps or set(a) != set(b):
        raise CheckFailed(f"the runs logged different steps: {sorted(a)} and {sorted(b)}")
    return max(abs(a[s] - b[s]) for s in steps)


def _compare(ctx: Ctx, item: str, got: dict, want: dict, tol_key: str) -> float:
    diff = _max_diff(got, want)
    tol = TOLERANCES[tol_key]
    ctx.check(item, diff, diff <= tol, f"<= {tol:g}")
    return diff


def part_numerics(ctx: Ctx) -> None:
    steps, cut = NUMERIC_STEPS[ctx.scale]
    dev = ctx.device.type
    common = [f"train.steps={steps}", "log.every=1"]
    _, ref = run_train(ctx, job(ctx, "default", *common, "launch.device='cpu'"))
    trajectories = {"ref_cpu_fp32": ref}
    for dtype in ("fp32", "bf16", "fp16"):
        result, losses = run_train(ctx, job(ctx, "default", *common, f"precision.dtype='{dtype}'"))
        trajectories[f"{dev}_{dtype}"] = losses
        _compare(ctx, f"{dtype} on {dev} vs CPU fp32: max |dloss| over {steps} steps", losses, ref, dtype)
        if dtype == "fp16":
            scaler = result.strategy.precision.scaler
            scale = float(scaler.get_scale())
            skipped = round(math.log2(scaler._init_scale / scale)) if scale < scaler._init_scale else 0
            ctx.metrics.update({"fp16_loss_scale": scale, "fp16_skipped_steps": skipped})
            ctx.row("fp16 loss scale at the end (steps skipped on overflow)", scale, note=f"{skipped} skipped")
    run_dir = ctx.workdir / "fp16-resume"
    cfg = job(ctx, "default", *common, "precision.dtype='fp16'")
    cfg.train.stop_after = cut
    _, first = run_train(ctx, cfg, run_dir)
    cfg.train.stop_after = 0
    _, rest = run_train(ctx, cfg, run_dir, resume=True)
    if sorted(first) != list(range(1, cut + 1)) or sorted(rest) != list(range(cut + 1, steps + 1)):
        raise CheckFailed(f"resume logged steps {sorted(first)} then {sorted(rest)}; expected 1-{cut} then {cut + 1}-{steps}")
    straight = trajectories[f"{dev}_fp16"]
    diff = _compare(ctx, f"fp16 resume: save {cut}, load, {cut + 1}-{steps} vs uninterrupted",
                    {**first, **rest}, straight, "resume")
    ctx.metrics.update({"trajectories": trajectories, "resumed": {**first, **rest}, "resume_max_diff": diff,
                        "resume_bitwise": all(rest[s] == straight[s] for s in rest)})
    if ctx.cuda:  # what fp16's loss scaling costs in syncs (GradScaler.step reads found_inf)
        probe = probe_for(ctx)
        run_train(ctx, job(ctx, "default", f"train.steps={steps}", f"log.every={steps}", "precision.dtype='fp16'"), warm=1)
        counts = [len(v) for v in probe.syncs.values()]
        ctx.metrics["fp16_syncs_per_non_logging_step"] = max(counts) if counts else None
        ctx.row("fp16 syncs per non-logging step (GradScaler)", max(counts) if counts else None,
                note="; ".join(sorted({s for v in probe.syncs.values() for s in v})[:2]))


def fsdp_gpt(vocab_size: int, context: int, width: int, heads: int, layers: int, device: str,
             param_dtype: str = "fp32"):
    """model.factory for the zero3 part: plait's GPT, ZeRO-3-sharded by plait's apply_fsdp on a 1-rank mesh."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from plait.config import ModelConfig
    from plait.data.spec import DataSpec
    from plait.models import build_model
    from plait.parallel.fsdp import apply_fsdp

    # The registry's GPT, built as `model.name = "gpt"` builds it: the same initial weights from the same seed.
    model_cfg = ModelConfig(vocab_size=vocab_size, context=context, width=width, heads=heads, layers=layers)
    spec = DataSpec(name="text", task="lm", input_shape=[context], vocab_size=vocab_size, tokens_per_sample=context)
    model = build_model(model_cfg, spec).to(device)
    mesh = init_device_mesh(torch.device(device).type, (1,), mesh_dim_names=("dp",))
    return apply_fsdp(model, mesh, stage=3, param_dtype=param_dtype)


def part_zero3(ctx: Ctx) -> None:
    steps, cut = NUMERIC_STEPS[ctx.scale]
    common = [f"train.steps={steps}", "log.every=1"]
    ref_result, ref = run_train(ctx, job(ctx, "default", *common, "launch.device='cpu'"))
    m = job(ctx, "default").model
    vocab = ref_result.module.tok_emb.num_embeddings

    def zero3(param_dtype: str, *extra: str):
        options = (f"{{vocab_size={vocab}, context={m.context}, width={m.width}, heads={m.heads}, layers={m.layers}, "
                   f"device='{ctx.device}', param_dtype='{param_dtype}'}}")
        return job(ctx, "default", *common, "model.factory='gpu_check:fsdp_gpt'", f"model.options={options}", *extra)

    result, z3 = run_train(ctx, zero3("fp32"))
    p = next(result.module.parameters())
    sharded = type(p).__name__ == "DTensor"
    mesh = tuple(p.device_mesh.shape) if sharded else ""
    ctx.check("parameters are DTensors on a 1-rank mesh (FSDP2 fully_shard)", f"{type(p).__name__} {mesh}", sharded)
    _compare(ctx, f"ZeRO-3 fp32 on {ctx.device.type} vs CPU fp32: max |dloss|", z3, ref, "fp32")
    run_dir = ctx.workdir / "zero3-resume"
    cfg = zero3("fp32")
    cfg.train.stop_after = cut
    _, first = run_train(ctx, cfg, run_dir)
    cfg.train.stop_after = 0
    _, rest = run_train(ctx, cfg, run_dir, resume=True)
    if sorted(rest) != list(range(cut + 1, steps + 1)):
        raise CheckFailed(f"the resumed ZeRO-3 run logged steps {sorted(rest)}, expected {cut + 1}-{steps}")
    diff = _compare(ctx, f"ZeRO-3 resume: save {cut}, load, {cut + 1}-{steps} vs uninterrupted",
                    {**first, **rest}, z3, "resume")
    _, z3_bf16 = run_train(ctx, zero3("bf16"))
    _compare(ctx, "ZeRO-3 bf16 (FSDP2 mixed precision) vs CPU fp32: max |dloss|", z3_bf16, ref, "bf16")
    ctx.metrics.update({"trajectories": {"ref_cpu_fp32": ref, "zero3_fp32": z3, "zero3_bf16": z3_bf16},
                        "resumed": {**first, **rest}, "resume_max_diff": diff,
                        "resume_bitwise": all(rest[s] == z3[s] for s in rest)})


def _serve_device_args(ctx: Ctx) -> list[str]:
    """`plait serve --device` for this run's device: cuda on a GPU run, cpu on a CPU one (never auto, which would
    pick a GPU for a --device cpu run on a machine that has one)."""
    return ["--device", ctx.device.type]


def part_serve(ctx: Ctx) -> None:
    import asyncio
    import urllib.request

    from plait import cli
    from plait.bench.serve import Point, ServerProcess, closed_loop, request_body
    from plait.serve.model.load import ModelRef, load_model

    device_args = _serve_device_args(ctx)
    s = SERVE[ctx.scale]
    c = s["concurrency"]
    run_dir = ctx.workdir / "run"
    # One step with plain SGD (no optimizer state: the checkpoint is the weights alone); speed does not depend on them.
    run_train(ctx, job(ctx, "large", "train.steps=1", "optim.name='sgd'", "optim.momentum=0.0"), run_dir)
    model_file = ctx.workdir / "model.safetensors"
    rc = cli.main(["export", str(run_dir), "-o", str(model_file)])
    if rc != 0:
        raise CheckFailed(f"plait export {run_dir} exited with {rc}")
    served = load_model(ModelRef(str(model_file)))
    prompt_ids = served.tokenizer.encode(s["prompt"])
    if len(prompt_ids) + s["new_tokens"] > served.context:
        raise CheckFailed(f"prompt + {s['new_tokens']} new tokens exceed the context {served.context}: no KV cache")
    infer_body = request_body(served)
    gen_body = json.dumps({"prompt": s["prompt"], "max_new_tokens": s["new_tokens"], "temperature": 0, "seed": 0}).encode()
    ctx.row("served model (exported with plait export)", sum(p.numel() for p in served.module.parameters()), "params",
            note=f"{model_file.stat().st_size / 2**20:.1f} MiB")
    del served
    points: list[Point] = []
    gen: dict[int, float] = {}
    mean_batch = None
    configs = (("batching off", ["--max-batch-size", "1", "--max-delay-ms", "0"]),
               ("batching on", ["--max-batch-size", str(max(c, 2)), "--max-delay-ms", "5"]))
    # Both servers start together (each imports torch and loads the model: seconds) and are measured one after the
    # other; the one not being measured is idle (on --tiny's 2 cores that saves a start-up, ~3 s of the part's ~13).
    starts: dict[str, ServerProcess | Exception] = {}

    def start(name: str, args: list[str]) -> None:
        try:
            starts[name] = ServerProcess(str(model_file), [*args, "--max-queue", "4096", *device_args])
        except Exception as e:  # raised below, once both have started or failed
            starts[name] = e

    threads = [threading.Thread(target=start, args=config) for config in configs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [e for e in starts.values() if isinstance(e, Exception)]
    if failed:
        for server in starts.values():
            if not isinstance(server, Exception):
                server.stop()
        raise failed[0]
    try:
        for name, _ in configs:
            server = starts[name]
            try:
                path = f"/v2/models/{server.name}/infer"
                url = f"http://{server.host}:{server.port}/metrics"
                for clients in (1, c):
                    before = _batches(urllib.request.urlopen(url, timeout=30).read().decode())
                    tput, lat, errors = asyncio.run(closed_loop(server.host, server.port, path, infer_body, clients,
                                                                s["warmup_s"], s["duration_s"]))
                    after = _batches(urllib.request.urlopen(url, timeout=30).read().decode())
                    points.append(Point(name, f"closed c={clients}", clients, None, tput, *_pcts(lat), errors))
                    print(f"[gpu_check] {name} c={clients}: {tput:.1f} req/s, {errors} errors", flush=True)
                    if name == "batching on" and clients == c and after[1] > before[1]:
                        mean_batch = (after[0] - before[0]) / (after[1] - before[1])
                if name == "batching on":
                    for clients in (1, c):
                        tput, lat, errors = asyncio.run(closed_loop(server.host, server.port, "/v1/generate", gen_body,
                                                                    clients, s["warmup_s"], s["gen_duration_s"]))
                        gen[clients] = tput * s["new_tokens"]
                        if errors or not lat:
                            raise CheckFailed(f"/v1/generate at concurrency {clients}: {errors} errors, {len(lat)} answers")
                        print(f"[gpu_check] generate c={clients}: {gen[clients]:.1f} tok/s", flush=True)
            finally:
                server.stop()
    finally:  # stopping is idempotent: a server left running by an error above stops here
        for server in starts.values():
            server.stop()
    errors = sum(p.errors for p in points)
    off = next(p for p in points if p.config == "batching off" and p.concurrency == c)
    on = next(p for p in points if p.config == "batching on" and p.concurrency == c)
    gain = on.throughput / off.throughput if off.throughput else math.inf
    for p in points:
        ctx.row(f"infer {p.config}, concurrency {p.concurrency}", p.throughput, "req/s", note=f"p99 {p.p99_ms:.1f} ms")
    if ctx.tiny:
        # A 0.4 M-parameter model computes a request in well under the HTTP round trip, on 2 cores shared with the
        # load generator: the throughput gain is noise there. What --tiny can assert is that batches formed.
        ctx.row(f"batching gain at concurrency {c} (on / off)", gain, "x", note="not asserted in --tiny")
        ctx.check(f"mean rows per batch, batching on, concurrency {c}", mean_batch,
                  mean_batch is not None and mean_batch > 1, "> 1")
    else:
        ctx.check(f"batching gain at concurrency {c} (on / off)", gain, gain > 1, "> 1", "x")
        ctx.row(f"batching gain at {c}, against plait bench serve's target", gain, "x", ">= 3", gain >= 3, "target")
        ctx.row(f"mean rows per batch, batching on, concurrency {c}", mean_batch)
    ctx.check("request errors", errors, errors == 0, "0")
    ctx.row(f"generate, concurrency 1 ({s['new_tokens']} new tokens, KV cache)", gen[1], "tok/s")
    ctx.row(f"generate, concurrency {c} (batched)", gen[c], "tok/s")
    ctx.metrics.update({
        "concurrency": c, "batching_gain": gain, "mean_batch_rows": mean_batch, "errors": errors,
        "generate_tokens_per_s": {str(k): v for k, v in gen.items()}, "new_tokens": s["new_tokens"],
        "prompt_tokens": len(prompt_ids), "points": [p.__dict__ for p in points],
        "served_on": device_args[-1],
    })


def _pcts(lat: list[float]) -> tuple[float, float, float]:
    from plait.bench.serve import _percentiles

    return _percentiles(lat)


def _batches(metrics_text: str) -> tuple[float, float]:
    """(rows, batches) so far, from the server's Prometheus histogram plait_batch_size."""
    rows = batches = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("plait_batch_size_sum"):
            rows = float(line.split()[-1])
        elif line.startswith("plait_batch_size_count"):
            batches = float(line.split()[-1])
    return rows, batches


PART_FUNCS = {
    "train_default": lambda ctx: part_train(ctx, "default"),
    "train_large": lambda ctx: part_train(ctx, "large"),
    "train_llama": lambda ctx: part_train(ctx, "llama"),
    "numerics": part_numerics,
    "zero3": part_zero3,
    "serve": part_serve,
}


if __name__ == "__main__":
    sys.exit(main())
