"""Every peer comparison in turn, each with its A/A control, in one table: `make bench`.

    python benchmarks/all.py [--only NAME,...] [--repeats 3] [--quick] [--out runs/bench]

A comparison measures a candidate side (plait) and a baseline side (the peer, or the hand-written loop) and divides
one by the other in each repeat. Every repeat also measures the baseline a second time, and the second baseline over
the first is the A/A ratio: what this machine's noise alone does to a ratio in the same run. Its largest distance
from 1 is the noise floor printed beside each comparison. The sides take turns (the order rotates from repeat to
repeat), so neither always runs first.

Before each group the machine must be quiet: the 1-minute load average below --max-load and other processes' CPU
(everything outside this benchmark's own process tree, sampled over a second) below --max-other-cpu cores. It waits
up to --quiet-wait seconds for that, then goes on and records that it was not quiet.

The groups (a group's sides are measured once per repeat and feed all its rows):

    own-loop   your loop under plait launch + plait.parallelize vs bare torchrun + DDP (own_loop.py), and
               Accelerate and Lightning Fabric on the same loop where installed            target <= 1.02
    small-step plait's trainer vs a hand-written DDP loop on the 0.4 M MLP (overhead.py --model mlp)   <= 1.02
    gpt        the same on the default GPT, DDP and FSDP2 (overhead.py --model gpt)                   <= 1.05
    serve      plait serve (exact) vs --no-exact-batching p50 at concurrency 1                       <= 1.05
               and plait serve req/s over LitServe's at each concurrency (serve_vs_litserve.py)      >= 1
    tune       an 8-trial study: plait tune's wall time over Ray Tune's (tune_startup.py)            <= 1
    deepspeed  ZeRO-3 step time, plait over DeepSpeed with every parameter sharded (zero_vs_deepspeed.py) <= 1
    llm        plait serve vs vLLM's CPU build on one random HF Llama (10 M and 100 M parameters), streamed
               /v1/completions, mixed / shared-prefix / long prompts at three Poisson rates
               (serve_vs_vllm.py, after its same-token check): output tok/s >= 1, TTFT p99 <= 1, ITL p99 <= 1.2
    finetune   full / LoRA / QLoRA fine-tuning of one random HF Llama on the same chat rows, 1 and 2 processes (ZeRO-3,
               the peers' FSDP): plait over TRL's SFTTrainer and torchtune's recipes, each in its own venv
               (finetune_vs_peers.py): tokens/s >= 1, peak RSS <= 1

A group whose peer is not installed is skipped with the reason (`pip install -e '.[bench]'` brings them). vLLM needs
a venv of its own, `.venv-vllm`, which the llm group makes when it is missing; the finetune group's peers live in
`.venv-trl` and `.venv-torchtune` (finetune_vs_peers.py's PEERS has the commands), skipped when both are missing.
Flower's comparison (fed_vs_flower.py) needs its own venv and is not run here.

Writes OUT/all.json (every measurement) and OUT/all.md (the table, for docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/ is not a package: its scripts are imported by name


@dataclass
class Row:
    label: str
    cand: str
    base: str
    metric: str
    better: str  # "lower" (times) or "higher" (throughputs)
    target: float | None  # None: a peer's own row, shown for reference


@dataclass
class Group:
    name: str
    sides: list[str]
    rows: list[Row]
    measure: Callable[[str, Any], dict[str, float]]
    setup: Callable[[Any, Path], Any] = lambda a, tmp: None
    teardown: Callable[[Any], None] = lambda ctx: None
    needs: dict[str, str] = field(default_factory=dict)  # module -> what installs it

    @property
    def bases(self) -> list[str]:
        return sorted({r.base for r in self.rows})


# ---------------------------------------------------------------------------------------------------------------
# is the machine quiet?

def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = {root}, [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _cpu_ticks() -> dict[int, int]:
    ticks = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
                ticks[int(d)] = int(fields[11]) + int(fields[12])  # utime + stime
            except (OSError, IndexError, ValueError):
                continue
    return ticks


def other_cpu(seconds: float = 1.0) -> float | None:
    """Cores used by processes outside this one's tree over `seconds` (None where /proc is not there)."""
    if not Path("/proc/self/stat").exists():
        return None
    mine = _descendants(os.getpid())
    t0, a = time.monotonic(), _cpu_ticks()
    time.sleep(seconds)
    b, dt = _cpu_ticks(), time.monotonic() - t0
    used = sum(v - a.get(p, v) for p, v in b.items() if p not in mine)
    return used / os.sysconf("SC_CLK_TCK") / dt


def wait_quiet(a) -> dict:
    """Wait until the load average and others' CPU are under the limits (or --quiet-wait passes); what was seen."""
    deadline = time.monotonic() + a.quiet_wait
    while True:
        load, other = os.getloadavg()[0], other_cpu()
        quiet = load <= a.max_load and (other is None or other <= a.max_other_cpu)
        if quiet or time.monotonic() >= deadline:
            seen = {"load": round(load, 2), "other_cpu": None if other is None else round(other, 3), "quiet": quiet}
            if not quiet:
                print(f"  not quiet after {a.quiet_wait:g} s (load {load:.2f}, others' CPU {other}): measuring anyway",
                      flush=True)
            return seen
        time.sleep(5)


# ---------------------------------------------------------------------------------------------------------------
# the groups

def _own_loop() -> Group:
    import own_loop

    peers = [s for s, mod in own_loop.NEEDS.items() if importlib.util.find_spec(mod) is not None]
    rows = [Row("own loop: plait.parallelize / torchrun + DDP", "plait", "torchrun", "s", "lower", 1.02),
            Row("own loop, CPU time per step: plait / torchrun", "plait", "torchrun", "cpu", "lower", None)]
    rows += [Row(f"own loop: {p} / torchrun + DDP", p, "torchrun", "s", "lower", None) for p in peers]

    def measure(side: str, ctx) -> dict[str, float]:
        wall, cpu = own_loop.run_side(side, ctx["work"], ctx["warmup"], ctx["steps"], cpu=True)
        return {"s": wall, "cpu": cpu}

    def setup(a, tmp: Path):
        return {"work": tmp, "warmup": 30, "steps": 150 if a.quick else 300}

    return Group("own-loop", ["torchrun", "plait", *peers], rows, measure, setup)


def _overhead(model: str, schemes: tuple[str, ...], target: float) -> Group:
    import overhead

    rows = [Row(f"{'0.4 M MLP' if model == 'mlp' else 'default GPT'} step: plait / hand-written "
                f"{'DDP' if s == 'ddp' else 'FSDP2'}", f"plait-{s}", f"raw-{s}", "s", "lower", target) for s in schemes]

    def setup(a, tmp: Path):
        from plait.testing import RankPool

        pool = RankPool(2, timeout_s=900)
        pool.__enter__()
        steps = {"mlp": 100 if a.quick else 200, "gpt": 30 if a.quick else 60}[model]
        return {"pool": pool, "tmp": tmp, "steps": steps, "n": 0}

    def measure(side: str, ctx) -> dict[str, float]:
        who, scheme = side.split("-")
        pool, ctx["n"] = ctx["pool"], ctx["n"] + 1
        if who == "raw":
            times = pool.run(overhead.raw_loop, model, 2, ctx["steps"], 10, scheme)[0][0]
            return {"s": statistics.median(overhead.windows(times))}
        extra = (f"parallel.zero={0 if scheme == 'ddp' else 3}",)
        got = pool.run(overhead.plait_loop, model, 2, ctx["steps"], 10, f"{ctx['tmp']}/run{ctx['n']}", extra)[0][0]
        return {"s": statistics.median(got)}

    sides = [f"{w}-{s}" for s in schemes for w in ("raw", "plait")]
    return Group("small-step" if model == "mlp" else "gpt", sides, rows, measure, setup,
                 teardown=lambda ctx: ctx["pool"].__exit__(None, None, None))


def _serve() -> Group:
    import serve_vs_litserve

    conc = (1, 4, 16, 64)
    rows = [Row("serving c=1: p50, exact / --no-exact-batching", "exact", "no-exact", "p50@1", "lower", 1.05)]
    rows += [Row(f"serving c={c}: req/s, plait serve / LitServe", "exact", "litserve", f"rps@{c}", "higher", 1.0)
             for c in conc]

    def setup(a, tmp: Path):
        import subprocess

        from plait.bench.serve import request_body
        from plait.serve.model.load import ModelRef, load_model

        run = tmp / "mlp17"  # the 17 M-parameter MLP; its weights need not be trained to time them
        subprocess.run([str(Path(sys.executable).parent / "plait"), "train", "--set", "model.name=mlp", "--set",
                        "data.name=digits", "--set", "model.width=2048", "--set", "model.depth=5", "--set",
                        "train.steps=1", "--set", "log.progress=false", "--set", "log.report=false", "--out", str(run)],
                       check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        body = request_body(load_model(ModelRef(str(run))), binary_outputs=False)
        args = SimpleNamespace(concurrency=list(conc), duration=2.0 if a.quick else 3.0, warmup=1.0, max_batch_size=16,
                               max_delay_ms=5.0)
        return {"run": str(run), "body": body, "args": args}

    def measure(side: str, ctx) -> dict[str, float]:
        got = serve_vs_litserve.run_side(side, ctx["run"], ctx["body"], ctx["args"])
        return {**{f"rps@{c}": v[0] for c, v in got.items()}, **{f"p50@{c}": v[1] for c, v in got.items()}}

    return Group("serve", ["exact", "no-exact", "litserve"], rows, measure, setup,
                 needs={"litserve": "pip install -e '.[bench]'", "httpx": "pip install httpx"})


def _tune() -> Group:
    import tune_startup

    rows = [Row("tune, 8 trials: wall, plait tune / Ray Tune", "plait tune", "Ray Tune", "s", "lower", 1.0)]

    def measure(side: str, ctx) -> dict[str, float]:
        return {"s": tune_startup.run_side(side, 8, 60)}

    return Group("tune", ["plait tune", "Ray Tune"], rows, measure, needs={"ray": "pip install -e '.[dev]'",
                                                                         "optuna": "pip install -e '.[tune]'"})


def _deepspeed() -> Group:
    import zero_vs_deepspeed as zd

    rows = [Row("ZeRO-3 step: plait / DeepSpeed (every parameter sharded)", "plait", "deepspeed", "s", "lower", 1.0)]

    def setup(a, tmp: Path):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # inherited by the ranks, before they import deepspeed
        args = SimpleNamespace(world=2, steps=10 if a.quick else 20, warmup=3, ds_adam="torch")
        return {"args": args, "tmp": str(tmp), "n": 0}

    def measure(side: str, ctx) -> dict[str, float]:
        ctx["n"] += 1
        label, persistence = ("plait", None) if side == "plait" else ("deepspeed p=0", 0)
        got = zd.run_one(label, 3, persistence, ctx["args"], 16, ctx["tmp"], str(ctx["n"]))
        if "error" in got:
            raise RuntimeError(f"{label}: {got['error'][-2000:]}")
        return {"s": statistics.median(got["ranks"][0]["times"])}

    return Group("deepspeed", ["plait", "deepspeed"], rows, measure, setup,
                 needs={"deepspeed": "pip install -e '.[bench]'"})


def _llm() -> Group:
    import serve_vs_vllm as sv

    why = sv.ensure_vllm(install=True)  # makes .venv-vllm when missing; the group is skipped if that fails
    targets = (("tok_s", "output tok/s", "higher", 1.0), ("ttft_p99", "TTFT p99", "lower", 1.0),
               ("itl_p99", "ITL p99", "lower", 1.2))
    rows = [Row(f"LLM {size} {w} {r}: {what}, plait serve / vLLM", "plait", "vllm", f"{m}@{size}/{w}/{r}", better,
                target)
            for size in sv.SIZES for w in sv.WORKLOADS for r in sv.RATES for m, what, better, target in targets
            if w == "mixed" or m == "tok_s"]

    def setup(a, tmp: Path):
        plans = [sv.new_plan(size, tmp, a.quick) for size in list(sv.SIZES)[:1 if a.quick else None]]
        # --quick, known only now, measures one size at one rate: the rows keep what is measured
        cells = {f"{p.size}/{w}/{q}" for p in plans for w in p.workloads for q in p.rates}
        rows[:] = [r for r in rows if r.metric.split("@")[1] in cells]
        for plan in plans:  # the same greedy tokens, and each side's capacity, before anything is timed
            sv.check_same(plan, allow_mismatch=False)
        return plans

    def measure(side: str, plans) -> dict[str, float]:
        return {f"{m}@{plan.size}/{cell}": v for plan in plans for cell, got in sv.session(plan, side).items()
                for m, v in got.items()}

    return Group("llm", ["vllm", "plait"], rows, measure, setup, needs={"vllm": sv.INSTALL} if why else {})


def _finetune() -> Group:
    import finetune_vs_peers as fp

    peers = [s for s in fp.SIDES[1:] if not fp.missing(s)]
    methods, worlds = ["full", "lora-all", "qlora"], [1, 2]
    rows = []
    for peer in peers:
        for m in methods:
            for w in worlds:
                if fp.runs(peer, w):
                    rows += [Row(f"finetune {m} dp{w}: tokens/s, plait / {peer}", "plait", peer, f"tok_s@{m}/dp{w}",
                                 "higher", 1.0),
                             Row(f"finetune {m} dp{w}: peak RSS, plait / {peer}", "plait", peer, f"rss@{m}/dp{w}",
                                 "lower", 1.0)]

    def setup(a, tmp: Path):
        # --quick, known only now, measures full and LoRA alone, each at 1 and 2 processes
        chosen = ["full", "lora-all"] if a.quick else methods
        rows[:] = [r for r in rows if r.metric.split("@")[1].split("/")[0] in chosen]
        args = fp.args(["--methods", ",".join(chosen), "--steps", "8" if a.quick else "12"])
        return fp.setup(args, tmp)

    # no peer venv: skipped (a module that is never there), with their commands
    needs = {} if peers else {"finetune_peer_venvs": "; ".join(str(fp.missing(s)) for s in fp.SIDES[1:])}
    return Group("finetune", ["plait", *peers], rows, fp.measure, setup, needs=needs)


GROUPS: dict[str, Callable[[], Group]] = {
    "own-loop": _own_loop,
    "small-step": lambda: _overhead("mlp", ("ddp",), 1.02),
    "gpt": lambda: _overhead("gpt", ("ddp", "fsdp"), 1.05),
    "serve": _serve,
    "tune": _tune,
    "deepspeed": _deepspeed,
    "llm": _llm,
    "finetune": _finetune,
}


# ---------------------------------------------------------------------------------------------------------------
# running them

def missing(group: Group) -> str | None:
    for mod, how in group.needs.items():
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed ({how})"
    return None


def run_group(group: Group, a, tmp: Path) -> dict:
    """Each repeat measures every side and every baseline twice, the order rotating; {side: [metrics per repeat]}."""
    plan = group.sides + [f"{b}#2" for b in group.bases]
    seen = [wait_quiet(a)]
    got: dict[str, list[dict[str, float]]] = {s: [] for s in plan}
    ctx = group.setup(a, tmp)
    try:
        for r in range(a.repeats):
            k = r % len(plan)
            for side in plan[k:] + plan[:k]:
                t0 = time.perf_counter()
                got[side].append(group.measure(side.split("#")[0], ctx))
                shown = ", ".join(f"{m} {v:.4g}" for m, v in got[side][-1].items() if "@" not in m or m.endswith("@1"))
                print(f"  {group.name} repeat {r + 1}/{a.repeats} {side:<14} {shown}  ({time.perf_counter() - t0:.0f} s)",
                      flush=True)
            seen.append({"load": round(os.getloadavg()[0], 2)})
    finally:
        group.teardown(ctx)
    return {"measured": got, "machine": seen}


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def judge(row: Row, got: dict[str, list[dict[str, float]]]) -> dict:
    ratios = [c[row.metric] / b[row.metric] for c, b in zip(got[row.cand], got[row.base])]
    aa = [b2[row.metric] / b[row.metric] for b2, b in zip(got[f"{row.base}#2"], got[row.base])]
    floor = max(abs(x - 1) for x in aa)
    out = {"label": row.label, "ratio": spread(ratios), "ratios": ratios, "aa": spread(aa), "aa_ratios": aa,
           "floor": floor, "target": None if row.target is None else f"{'<=' if row.better == 'lower' else '>='} "
                                                                      f"{row.target:g}"}
    if row.target is None:
        out["verdict"] = "(peer, for reference)"
        return out
    med = out["ratio"]["median"]
    met = med <= row.target if row.better == "lower" else med >= row.target
    out["verdict"] = "met" if met else ("not met, within the A/A floor" if abs(med - row.target) <= floor
                                        else "not met")
    return out


def table(results: list[dict]) -> str:
    lines = ["| comparison | ratio min / median / max | A/A min / median / max | noise floor | target | verdict | "
             "load before |", "|---|---:|---:|---:|---:|---|---:|"]
    for g in results:
        if "skipped" in g:
            lines.append(f"| {g['group']} | - | - | - | - | skipped: {g['skipped']} | - |")
            continue
        for row in g["rows"]:
            r, aa = row["ratio"], row["aa"]
            lines.append(f"| {row['label']} | {r['min']:.3f} / {r['median']:.3f} / {r['max']:.3f} | "
                         f"{aa['min']:.3f} / {aa['median']:.3f} / {aa['max']:.3f} | {row['floor']:.3f} | "
                         f"{row['target'] or '-'} | {row['verdict']} | {g['machine'][0]['load']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="groups: " + ", ".join(GROUPS))
    ap.add_argument("--only", default="", help="comma-separated groups to run (default: all)")
    ap.add_argument("--repeats", type=int, default=3, help="repeats per group (each measures the baseline twice)")
    ap.add_argument("--quick", action="store_true", help="fewer steps and shorter serving runs")
    ap.add_argument("--max-load", type=float, default=1.5, help="the 1-minute load average a quiet machine stays under")
    ap.add_argument("--max-other-cpu", type=float, default=0.25, help="cores other processes may use")
    ap.add_argument("--quiet-wait", type=float, default=120, help="seconds to wait for a quiet machine before each group")
    ap.add_argument("--out", default="runs/bench", help="where all.json and all.md go")
    a = ap.parse_args(argv)
    names = [n for n in a.only.split(",") if n] or list(GROUPS)
    unknown = [n for n in names if n not in GROUPS]
    if unknown:
        ap.error(f"--only {','.join(unknown)}: no such group (the groups: {', '.join(GROUPS)})")
    if a.repeats < 2:
        ap.error("--repeats must be at least 2: a ratio's spread needs two")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    results = []
    started = time.time()
    for name in names:
        group = GROUPS[name]()
        why = missing(group)
        print(f"{name}: " + (f"skipped, {why}" if why else f"{len(group.sides)} sides, {a.repeats} repeats"), flush=True)
        if why:
            results.append({"group": name, "skipped": why})
            continue
        with tempfile.TemporaryDirectory() as tmp:
            done = run_group(group, a, Path(tmp))
        rows = [judge(row, done["measured"]) for row in group.rows]
        results.append({"group": name, **done, "rows": rows})
        for row in rows:
            print(f"  {row['label']}: median {row['ratio']['median']:.3f} (A/A floor {row['floor']:.3f}) {row['verdict']}",
                  flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    text = table(results)
    meta = {"started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)), "seconds": time.time() - started,
            "cpus": os.cpu_count(), "repeats": a.repeats, "quick": a.quick}
    (out / "all.json").write_text(json.dumps({**meta, "groups": results}, indent=1))
    (out / "all.md").write_text(text + "\n")
    print(f"\n{text}\n\n{len(names)} groups in {meta['seconds']:.0f} s; wrote {out / 'all.json'} and {out / 'all.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
