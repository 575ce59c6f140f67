"""plait's ZeRO stages next to DeepSpeed's ZeRO-1/2/3: same model, data, batch and optimizer, on CPU with gloo.

For each stage k in --stages (default 0,1,2,3; 0 is the data-parallel baseline: plait's DDP,
DeepSpeed without ZeRO) both implementations train the default job's GPT (plait.models.gpt.GPT
with the default config's shapes and the stdlib-text vocabulary) from the same initial weights
(plait's seed) on the same data order (plait's GlobalBatchSampler and StepLoader, each rank its
slice of the global batch), global batch 32, fp32, AdamW (lr 6e-3, betas (0.9, 0.95), wd 0.01
on matrices and embeddings, eps 1e-8), plait's learning-rate schedule and gradient clipping 1.0:

    plait      plait's own trainer (plait.train.trainer.train) with parallel.zero = k
    deepspeed  deepspeed.initialize(config={zero_optimization: {stage: k}, optimizer: AdamW, ...}) and a
               loop of engine(x) / engine.backward(loss) / engine.step() over the same micro-batches

Each run gets fresh rank processes (plait.testing.RankPool: --world gloo ranks, one thread each,
OMP_NUM_THREADS=1), so peak RSS belongs to that run. The two implementations alternate (which one
goes first flips from stage to stage and repeat to repeat); the first --warmup steps of every run
are not timed, and step time is the median of rank 0's per-step times (plait: its own metrics,
logged every step; DeepSpeed: the same span, from fetching the batch to the logged loss).

Memory per rank, counted from the tensors the rank holds, distinct storages once (as
plait.train.memory does):

    plait      its summary's memory.per_rank: parameters and optimizer state (local shards) at the
               end, gradients right after forward_backward on the first and last step
    deepspeed  every tensor reachable from the model's parameters (their .grad and, at stage 3,
               .ds_tensor) and from engine.optimizer (the ZeRO optimizer's attributes, its inner
               torch optimizer's state and param_groups, and their .grad), walked after every
               micro-batch's engine.backward on the first and last step (before engine.step) and
               at the end. Meta tensors hold no memory and are skipped. Each distinct storage is
               counted once, in the first of these that any path to it belongs to:
        params   the module's parameters (stage 1/2: views into bit16_groups_flat; stage 3: the
                 ds_tensor partitions, plus whole parameters kept "persistent", see below)
        optim    the inner optimizer's state (exp_avg, exp_avg_sq, step)
        grads    .grad of anything (parameters, the fp32 partitions)
        master   the fp32 partition the optimizer steps: single_partition_of_fp32_groups at stage
                 1/2, fp32_partitioned_groups_flat at stage 3. A copy of the parameters' partition
                 even in fp32 training (stage 3 would share it when dtype and device match, but
                 compares a torch.device with the string 'cpu', so on CPU it copies too)
        grads    optimizer attributes named for gradients (averaged_gradients, grads_in_partition,
                 grad_partitions_flat_buffer, ...)
        buffers  the rest: reduce buckets (ipg_buffer; at stage 3 ipg_buckets[].buffer, allocated
                 at reduce_bucket_size = 5e8 elements) and small scalars
    gradients are taken at their largest after a backward, buffers at their largest, the rest at
    the end; the JSON lists the attributes behind every category ("where").
    DeepSpeed's stage 3 keeps parameters under stage3_param_persistence_threshold (1e5 elements by
    default: every parameter of this model) whole on every rank; the extra row "deepspeed p=0"
    (--ds-shard-all, on by default) sets it to 0 so that every parameter is sharded.

state = params + grads + optim (+ master for DeepSpeed), next to the ZeRO paper's fp32 AdamW
formula (plait.launch.bench_memory.formula_bytes, K = 8). Bytes sent per step are counted by
plait.comm.counting, which wraps torch.distributed's collectives (DeepSpeed calls them too).
A stage that fails prints its error in the table and in the JSON instead of numbers.

Usage, in a separate venv (DeepSpeed is never a dependency of plait; plait is installed there editable):

    python3 -m venv .venv-deepspeed && .venv-deepspeed/bin/pip install "torch==2.13.0"
    .venv-deepspeed/bin/pip install -e . && DS_BUILD_OPS=0 .venv-deepspeed/bin/pip install --no-build-isolation deepspeed
    .venv-deepspeed/bin/python benchmarks/zero_vs_deepspeed.py [--steps 20] [--warmup 3] [--world 2] [--stages 0,1,2,3]
        [--repeats 1] [--micro N] [--ds-adam torch|fused] [--no-ds-shard-all] [--blocking] [--json runs/zero_vs_deepspeed.json]

--blocking adds a row "plait blocking" at stage 3: plait's ZeRO-3 with FSDP2's own collectives, each of which
blocks the Python thread on a CPU (plait.parallel.fsdp.overlap_without_streams off), the baseline for the overlap.

--ds-adam torch (default) has DeepSpeed step torch.optim.AdamW (its "torch_adam" option), the
optimizer plait uses, so only the ZeRO machinery differs; fused uses DeepSpeed's own AdamW kernel
(FusedAdam, JIT-compiled for the CPU on first use). DeepSpeed's first run JIT-compiles its
shared-memory comm op (about a minute, cached under ~/.cache/torch_extensions). With --world 4
the micro-batch is 8 (32 / 4 ranks).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import statistics
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import torch
import torch.distributed as dist

from plait.config import load_config
from plait.launch.bench_memory import formula_bytes
from plait.testing import RankPool

MIB = 1024 * 1024


def config(world: int, steps: int, zero: int, micro: int):
    return load_config(None, [
        f"parallel.dp={world}", f"parallel.zero={zero}", f"train.steps={steps}", f"train.micro_batch_size={micro}",
        "log.every=1", "log.progress=false", "log.report=false", "train.sample_tokens=0", "train.eval_samples=16",
        "checkpoint.every=0",
    ])


# ---- process memory: peak RSS of the whole process, and the peak since a reset ----

def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_rss() -> int | None:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS; returns that RSS in bytes (None where unsupported)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    rss = _status_kib("VmRSS")
    return rss * 1024 if rss is not None else None


def rss_now_and_peak() -> tuple[int | None, int]:
    """(peak RSS since reset_peak_rss, or None; peak RSS of the process's whole life), bytes."""
    import resource

    hwm = _status_kib("VmHWM")
    return (hwm * 1024 if hwm is not None else None), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- plait ----

def plait_run(zero: int, world: int, steps: int, warmup: int, micro: int, run_dir: str, blocking: bool = False) -> dict:
    import plait.parallel.fsdp as fsdp
    import plait.train.build as build
    import plait.train.trainer as trainer
    from plait.data import build_data
    from plait.train.telemetry import Telemetry

    stamps = []  # the process's CPU time (all its threads: compute and gloo's) as each step ends
    end = Telemetry.end

    def timed_end(self, *args, **kwargs):
        stamps.append(time.process_time())
        return end(self, *args, **kwargs)

    Telemetry.end = timed_end
    if blocking:  # FSDP2's own collectives, each blocking the Python thread on CPU (plait before the overlap)
        fsdp.overlap_without_streams = lambda *args: None
    cfg = config(world, warmup + steps, zero, micro)
    bundle = build_data(cfg.data, cfg.model)  # before the RSS baseline, as on the DeepSpeed side
    build.build_data = lambda data_cfg, model_cfg: bundle  # the job builds its data through this name
    base = reset_peak_rss()
    with contextlib.redirect_stdout(io.StringIO()):  # the trainer's own report lines
        result = trainer.train(cfg, run_dir)
    since, life = rss_now_and_peak()
    mine = {"peak_rss_bytes": life, "rss_growth_bytes": since - base if since is not None and base is not None else None}
    if dist.get_rank() != 0:
        return mine
    s = result.summary
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if "step_time_s" in r]
    cpu = [stamps[s - 1] - stamps[s - 2] for s in range(max(warmup, 1) + 1, len(stamps) + 1)]
    return {**mine, "times": [r["step_time_s"] for r in steps_rows if r["step"] > warmup], "cpu_times": cpu,
            "losses": [r["loss"] for r in steps_rows], "per_rank": s["memory"]["per_rank"], "psi": s["params"],
            "strategy": s["parallel"]["strategy"], "comm_bytes": s["comm"]["bytes_per_step_per_rank"]}


# ---- DeepSpeed ----

def _walk(obj, path: str, out: list, seen: set, depth: int = 0) -> None:
    """Every tensor reachable from obj through containers and DeepSpeed / torch.optim objects, as (path, tensor);
    a tensor reached along several paths is listed under each."""
    if depth > 8:
        return
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
        if id(obj) not in seen:
            seen.add(id(obj))
            if obj.grad is not None:
                _walk(obj.grad, path + ".grad", out, seen, depth + 1)
            ds = getattr(obj, "ds_tensor", None)
            if isinstance(ds, torch.Tensor):
                _walk(ds, path + ".ds_tensor", out, seen, depth + 1)
        return
    if id(obj) in seen or isinstance(obj, torch.nn.Module):  # the model is walked through its parameters
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(k, torch.Tensor):
                _walk(k, f"{path}[key]", out, seen, depth + 1)
            _walk(v, f"{path}[{k if isinstance(k, (str, int)) else type(k).__name__}]", out, seen, depth + 1)
    elif isinstance(obj, (list, tuple, set)):
        for i, v in enumerate(obj):
            _walk(v, f"{path}[{i}]", out, seen, depth + 1)
    elif type(obj).__module__.startswith(("deepspeed", "torch.optim")) and hasattr(obj, "__dict__"):
        for k, v in vars(obj).items():
            _walk(v, f"{path}.{k}", out, seen, depth + 1)


MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat")
CATEGORIES = ("params", "grads", "optim", "master", "buffers")


def _category(paths: list[str], param_paths: set[str], optim: bool) -> str:
    """The first category (params, optim, master, grads, buffers) that any path to a storage belongs to."""
    if any(p in param_paths for p in paths):
        return "params"
    if optim:
        return "optim"
    if any(p.endswith(".grad") for p in paths):
        return "grads"  # checked before master: the fp32 partition's .grad is a gradient
    if any(w in p for p in paths for w in MASTER_ATTRS) or any(".param_groups[" in p for p in paths):
        return "master"
    names = [re.sub(r"\[[^\]]*\]", "", p).rsplit(".", 1)[-1].lower() for p in paths]
    if any("grad" in n and not any(w in n for w in ("ipg", "bucket", "norm")) for n in names):
        return "grads"
    return "buffers"


def ds_memory(engine, module: torch.nn.Module) -> dict:
    """Bytes per category (see the module docstring) and the attributes behind them, from what the rank holds now."""
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)  # ZeRO wraps a torch optimizer; stage 0 in fp32 uses it directly
    found: list = []
    seen: set = set()
    param_paths = set()
    for name, p in module.named_parameters():
        param_paths |= {name, name + ".ds_tensor"}
        _walk(p, name, found, seen)
    _walk(opt, "optimizer", found, seen)
    optim_ids = {id(v) for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)}
    storages: dict[tuple, list] = {}  # storage -> [bytes, paths, held as optimizer state]
    for path, t in found:
        if t.numel() == 0 or t.device.type == "meta":  # meta tensors (DeepSpeed's shape records) hold no memory
            continue
        st = t.untyped_storage()
        entry = storages.setdefault((t.device.type, t.device.index, st.data_ptr()), [0, [], False])
        entry[0] = max(entry[0], st.nbytes())
        entry[1].append(path)
        entry[2] = entry[2] or id(t) in optim_ids
    out = dict.fromkeys(CATEGORIES, 0)
    where: dict[str, dict[str, int]] = {c: {} for c in CATEGORIES}
    for nbytes, paths, optim in storages.values():
        cat = _category(paths, param_paths, optim)
        out[cat] += nbytes
        short = re.sub(r"\[[^\]]*\]", "[]", min(paths, key=len))
        where[cat][short] = where[cat].get(short, 0) + nbytes
    return {"bytes": out, "where": where}


def ds_run(zero: int, world: int, steps: int, warmup: int, micro: int, adam: str, persistence: int | None) -> dict:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch: DeepSpeed calls the deprecated collective names
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed's op-build messages
        import deepspeed
    from deepspeed.utils import logger as ds_logger

    from plait.comm.accounting import CommCounter, counting
    from plait.data import build_data
    from plait.data.loader import StepLoader
    from plait.data.sampler import GlobalBatchSampler
    from plait.models import build_model
    from plait.runtime import seed_all
    from plait.train.loss import loss_for
    from plait.train.optim import lr_at, param_groups

    ds_logger.setLevel(logging.WARNING)
    total = warmup + steps
    cfg = config(world, total, zero, micro)
    t, o = cfg.train, cfg.optim
    bundle = build_data(cfg.data, cfg.model)
    base = reset_peak_rss()
    seed_all(t.seed)  # as plait's trainer: the same initial weights
    module = build_model(cfg.model, bundle.spec)
    loss_fn = loss_for(bundle.spec)
    accum = t.global_batch_size // (t.micro_batch_size * world)
    ds_config = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": accum,
        "optimizer": {"type": "AdamW", "params": {"lr": o.lr, "betas": list(o.betas), "eps": o.eps,
                                                   "weight_decay": o.weight_decay, "torch_adam": adam == "torch"}},
        "gradient_clipping": o.grad_clip,
        "zero_optimization": {"stage": zero, **({"stage3_param_persistence_threshold": persistence}
                                                if persistence is not None else {})},
        "fp16": {"enabled": False}, "bf16": {"enabled": False},
        "steps_per_print": 10**9, "wall_clock_breakdown": False,
    }
    before_init = _status_kib("VmRSS")
    with contextlib.redirect_stdout(io.StringIO()):
        engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=param_groups(module, o.weight_decay),
                                               config=ds_config, dist_init_required=False)
    after_init = _status_kib("VmRSS")
    engine.train()
    sampler = GlobalBatchSampler(len(bundle.train), t.global_batch_size, t.seed)
    loader = StepLoader(bundle.train, sampler, 0, total, dist.get_rank(), world, t.micro_batch_size, cfg.data.prefetch)
    measure_at = {1, total}  # as plait's trainer: the first and the last step
    after_backward: list[dict] = []
    times, cpu_times, losses = [], [], []
    comm = CommCounter()
    batches = iter(loader)
    with counting(comm):
        for step in range(total):
            t0, c0 = time.perf_counter(), time.process_time()
            micro_batches = next(batches)
            for g in engine.optimizer.param_groups:
                g["lr"] = lr_at(step, o, total)
            window = torch.zeros(())
            walking = 0.0  # the memory walk's own time, left out of the step time
            for x, y in micro_batches:
                loss = loss_fn(engine(x), y)
                engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself
                window += loss.detach()
                if step + 1 in measure_at:  # after every backward: accumulating ones hold gradients differently
                    w0 = time.perf_counter()
                    after_backward.append(ds_memory(engine, module))
                    walking += time.perf_counter() - w0
                engine.step()  # an optimizer step only at the accumulation boundary
            window /= len(micro_batches)
            dist.all_reduce(window)  # the dp-mean loss, as plait logs it every step
            losses.append(float(window) / world)
            if step >= warmup:
                times.append(time.perf_counter() - t0 - walking)
                cpu_times.append(time.process_time() - c0 - walking)
    batches.close()
    end = ds_memory(engine, module)
    fullest = max(after_backward, key=lambda m: m["bytes"]["grads"])
    mem = dict(end["bytes"])  # parameters, optimizer state and master weights at the end
    mem["grads"] = max(end["bytes"]["grads"], fullest["bytes"]["grads"])  # gradients at their largest after a backward
    mem["buffers"] = max(m["bytes"]["buffers"] for m in [*after_backward, end])
    since, life = rss_now_and_peak()
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    psi = sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())
    return {"times": times, "cpu_times": cpu_times, "losses": losses, "memory": mem,
            "where": {"after_backward": fullest["where"], "end": end["where"]},
            "peak_rss_bytes": life, "rss_growth_bytes": since - base if since is not None and base is not None else None,
            "initialize_rss_bytes": (after_init - before_init) * 1024 if after_init and before_init else None,
            "comm_bytes": comm.bytes_sent / total, "comm_by_op": {k: v / total for k, v in comm.by_op.items()},
            "comm_calls_per_step": {k: v / total for k, v in comm.calls.items()}, "psi": psi,
            "optimizer": f"{type(opt).__name__} over {type(inner).__module__.split('.')[0]}.{type(inner).__name__}",
            "deepspeed": deepspeed.__version__}


# ---- driver ----

def variants(stages: list[int], shard_all: bool, blocking: bool = False) -> list[tuple[str, int, int | None]]:
    """(label, zero, DeepSpeed's stage3_param_persistence_threshold or None) for every run, stage by stage."""
    out = []
    for zero in stages:
        out += [("plait", zero, None), ("deepspeed", zero, None)]
        if zero == 3 and shard_all:
            out.append(("deepspeed p=0", zero, 0))
        if zero == 3 and blocking:
            out.append(("plait blocking", zero, None))
    return out


def run_one(label: str, zero: int, persistence: int | None, a, micro: int, tmp: str, tag: str) -> dict:
    """One run on fresh ranks: {'ranks': each rank's result} or {'error': why it failed}."""
    try:
        with RankPool(a.world, timeout_s=900) as pool:
            if label.startswith("plait"):
                got = pool.run(plait_run, zero, a.world, a.steps, a.warmup, micro, f"{tmp}/{label}-zero{zero}-{tag}",
                               label == "plait blocking")
            else:
                got = pool.run(ds_run, zero, a.world, a.steps, a.warmup, micro, a.ds_adam, persistence)
    except Exception as e:  # noqa: BLE001 - a stage that cannot run is reported and the others go on
        return {"error": f"{type(e).__name__}: {e}"[-6000:]}
    return {"ranks": got}


def summarize(label: str, zero: int, runs: list[dict], world: int) -> dict:
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        return {"impl": label, "zero": zero, "error": errors[0]}
    times = [x for r in runs for x in r["ranks"][0]["times"]]
    first = runs[0]["ranks"]
    if label.startswith("plait"):
        per_rank = [{"params": m["params_bytes"], "grads": m["grads_bytes"], "optim": m["optimizer_bytes"], "master": 0,
                     "buffers": 0} for m in first[0]["per_rank"]]
        comm, extra = max(first[0]["comm_bytes"]), {"what": f"plait {first[0]['strategy']}"}
    else:
        per_rank = [dict(r["memory"]) for r in first]
        comm = max(r["comm_bytes"] for r in first)
        extra = {"what": first[0]["optimizer"], "where": first[0]["where"], "comm_by_op": first[0]["comm_by_op"],
                 "initialize_rss_bytes": max(r["initialize_rss_bytes"] or 0 for r in first),
                 "comm_calls_per_step": first[0]["comm_calls_per_step"]}
    for m in per_rank:
        m["state"] = m["params"] + m["grads"] + m["optim"] + m["master"]
    worst = max(range(world), key=lambda i: per_rank[i]["state"])
    psi = first[0]["psi"]
    formula = formula_bytes(zero, psi, world)
    return {
        "impl": label, "zero": zero, **extra, "psi": psi, "n": world, "largest_rank": worst, **per_rank[worst],
        "formula_bytes": formula, "ratio": per_rank[worst]["state"] / formula, "per_rank": per_rank,
        "peak_rss_bytes": max(r["peak_rss_bytes"] for run in runs for r in run["ranks"]),
        "rss_growth_bytes": max((r["rss_growth_bytes"] or 0) for run in runs for r in run["ranks"]),
        "step_time_s": statistics.median(times), "timed_steps": len(times), "comm_bytes_per_step": comm,
        "cpu_time_s": statistics.median(x for r in runs for x in r["ranks"][0]["cpu_times"]),
        "best_run_step_time_s": min(statistics.median(r["ranks"][0]["times"]) for r in runs),
        "losses": first[0]["losses"], "final_loss": first[0]["losses"][-1],
    }


def print_table(rows: list[dict], a, micro: int) -> None:
    from rich.console import Console
    from rich.table import Table

    ok = [r for r in rows if "error" not in r]
    psi = ok[0]["psi"] if ok else 0
    accum = 32 // (micro * a.world)
    t = Table(title=f"plait ZeRO vs DeepSpeed ZeRO: default GPT (Psi = {psi:,}), {a.world} gloo ranks on CPU, global batch 32 "
                    f"= {micro} x {accum} accum x {a.world}, fp32 AdamW; MiB per rank (the rank holding the most state)")
    for col in ("zero", "impl", "params", "grads", "optim", "master", "state", "formula", "ratio", "buffers",
                "peak RSS", "+RSS", "step ms", "best ms", "CPU ms", "sent MiB", "loss"):
        t.add_column(col, justify="left" if col == "impl" else "right")
    for i, r in enumerate(rows):
        if "error" in r:
            t.add_row(str(r["zero"]), r["impl"], f"[red]failed: {r['error'].splitlines()[-1][:120]}[/red]")
        else:
            t.add_row(str(r["zero"]), r["impl"], *(f"{r[k] / MIB:.2f}" for k in ("params", "grads", "optim", "master",
                                                                                  "state", "formula_bytes")),
                      f"{r['ratio']:.3f}", f"{r['buffers'] / MIB:.2f}", f"{r['peak_rss_bytes'] / MIB:.0f}",
                      f"{r['rss_growth_bytes'] / MIB:.0f}", f"{r['step_time_s'] * 1000:.1f}",
                      f"{r['best_run_step_time_s'] * 1000:.1f}", f"{r['cpu_time_s'] * 1000:.1f}",
                      f"{r['comm_bytes_per_step'] / MIB:.2f}", f"{r['final_loss']:.4f}")
        if i + 1 < len(rows) and rows[i + 1]["zero"] != r["zero"]:
            t.add_section()
    Console(width=180).print(t)
    print(f"""\
state = params + grads + optim + master, measured on the rank holding the most; formula = the ZeRO paper's model state for fp32
  AdamW (K = 8): 16 Psi, 8 Psi + 8 Psi/N, 4 Psi + 12 Psi/N, 16 Psi/N; ratio = state / formula.
params/optim/master at the end; grads at their largest right after a backward (transient gradients inside backward are not counted).
master = DeepSpeed's fp32 partition that its optimizer steps (a copy of the parameters' partition at stage 1/2, even in fp32).
buffers = other tensors DeepSpeed holds (reduce buckets, ...), counted at their allocated size: torch.empty leaves untouched
  pages unallocated, so +RSS is the better guide to what they cost.
peak RSS = the largest rank process's peak (torch, DeepSpeed and the dataset included); +RSS = its largest growth from
  the dataset being loaded to the end (model, optimizer, ZeRO machinery, activations; plait's also its final eval and checkpoint).
step ms = median of rank 0's step times after {a.warmup} warm-up steps ({a.steps} timed x {a.repeats} repeat(s)); best ms = the
  lowest of the repeats' medians (the least disturbed by other load on the machine); CPU ms = median CPU time of rank 0's
  process per step (all its threads: compute and gloo's; less sensitive to other load than wall time);
  sent = bytes a rank sends per step (each collective's ring share, counted by plait.comm);
  loss = the dp-mean training loss at the last step.
DeepSpeed's AdamW: {'torch.optim.AdamW ("torch_adam": true), as plait' if a.ds_adam == 'torch' else "DeepSpeed's FusedAdam (CPU)"}.\
""")
    for r in ok:
        if not r["impl"].startswith("plait"):
            line = f"zero={r['zero']} {r['impl']}: deepspeed.initialize added {r['initialize_rss_bytes'] / MIB:.0f} MiB of RSS"
            if r["buffers"] > MIB:
                name, nbytes = max(((k, v) for w in r["where"].values() for k, v in w["buffers"].items()), key=lambda kv: kv[1])
                line += f"; largest buffer {name} = {nbytes / MIB:.1f} MiB"
            print(line)
    if any(r["impl"] == "plait blocking" for r in rows):
        print("plait blocking: ZeRO-3 with FSDP2's own collectives, each of which blocks the Python thread on a CPU (no "
              "streams): plait before\n  its all-gathers were made asynchronous and its reduce-scatters deferred by one unit.")
    if any(r["impl"] == "deepspeed p=0" for r in rows):
        print("deepspeed p=0: stage3_param_persistence_threshold = 0. DeepSpeed's default (1e5 elements) keeps every parameter "
              "smaller than that\n  whole on every rank, which here is all of them, so its default stage 3 shards only "
              "gradients and optimizer state.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--world", type=int, default=2, help="gloo ranks (data-parallel degree)")
    ap.add_argument("--micro", type=int, default=0, help="micro-batch size (default: 16, or 32 / world if smaller)")
    ap.add_argument("--stages", default="0,1,2,3", help="ZeRO stages to compare, comma-separated")
    ap.add_argument("--repeats", type=int, default=1, help="runs per implementation and stage (alternating)")
    ap.add_argument("--ds-adam", choices=("torch", "fused"), default="torch",
                    help="DeepSpeed's AdamW: torch.optim.AdamW (as plait) or DeepSpeed's FusedAdam")
    ap.add_argument("--ds-shard-all", action=argparse.BooleanOptionalAction, default=True,
                    help="also run DeepSpeed stage 3 with stage3_param_persistence_threshold = 0 (every parameter sharded)")
    ap.add_argument("--blocking", action="store_true",
                    help="also run plait's ZeRO-3 with FSDP2's blocking collectives (plait before the CPU overlap)")
    ap.add_argument("--json", default="runs/zero_vs_deepspeed.json", help="where to write the results")
    a = ap.parse_args()
    stages = [int(s) for s in a.stages.split(",")]
    if a.world < 2:
        sys.exit("--world must be at least 2: ZeRO shards over data-parallel ranks")
    micro = a.micro or min(16, 32 // a.world)
    if 32 % (micro * a.world):
        sys.exit(f"the global batch (32) must divide into micro-batches of {micro} on {a.world} ranks")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # inherited by the ranks, before they import deepspeed
    plan = variants(stages, a.ds_shard_all, a.blocking)
    runs: dict[tuple[str, int], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.repeats):
            for zero in stages:
                todo = [v for v in plan if v[1] == zero]
                if (zero + rep) % 2:
                    todo.reverse()  # neither implementation always goes first
                for label, _, persistence in todo:
                    t0 = time.perf_counter()
                    got = run_one(label, zero, persistence, a, micro, tmp, str(rep))
                    runs.setdefault((label, zero), []).append(got)
                    if "error" in got:
                        print(f"zero={zero} {label:13}: FAILED {got['error'].splitlines()[-1]}", flush=True)
                    else:
                        med = statistics.median(got["ranks"][0]["times"])
                        print(f"zero={zero} {label:13}: median {med * 1000:.1f} ms/step (run {time.perf_counter() - t0:.0f} s)",
                              flush=True)
    rows = [summarize(label, zero, runs[(label, zero)], a.world) for label, zero, _ in plan]
    print()
    print_table(rows, a, micro)
    print(f"bytes a rank sends per step, counted per collective (plait.comm.accounting), next to the ZeRO paper's volume "
          f"in fp32, (n-1)/n x 4 bytes x 2 Psi (zero 0-2) or 3 Psi (zero 3), n = {a.world}:")
    for r in rows:
        if "error" not in r:
            want = (3 if r["zero"] == 3 else 2) * (a.world - 1) / a.world * 4 * r["psi"]
            print(f"  zero={r['zero']} {r['impl']:13}: {r['comm_bytes_per_step']:,.0f} B, formula {want:,.0f} B "
                  f"(x{r['comm_bytes_per_step'] / want:.4f})")
    for zero in stages:
        mine = next(r for r in rows if r["impl"] == "plait" and r["zero"] == zero)
        for r in rows:
            if r["zero"] == zero and r["impl"] != "plait" and "error" not in r and "error" not in mine:
                diff = max(abs(x - y) for x, y in zip(mine["losses"], r["losses"]))
                ratio = r["step_time_s"] / mine["step_time_s"]
                print(f"zero={zero}: {r['impl']} / plait step time = {ratio:.3f} "
                      f"(best runs: {r['best_run_step_time_s'] / mine['best_run_step_time_s']:.2f}; "
                      f"CPU time per step: {r['cpu_time_s'] / mine['cpu_time_s']:.2f}); "
                      + (f"target (>= 1.0) {'met' if ratio >= 1.0 else 'not met'}; " if r["impl"].startswith("deepspeed") else "")
                      + f"largest loss difference over {len(r['losses'])} steps = {diff:.1e}")
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "micro_batch_size": micro, "torch": torch.__version__,
                               "deepspeed": version("deepspeed"), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
