"""Your own training loop under each launcher: bare torchrun + DDP = 1.000, plait launch + plait.parallelize, and
Accelerate and Lightning Fabric under torchrun when they are installed. Target: plait / torchrun <= 1.02.

The same loop everywhere: an MLP (64 -> 600 -> 600 -> 10, 0.4 M parameters) on 4096 random samples, AdamW, 2 gloo
ranks with one thread each, 32 samples per rank and step (global batch 64), `--steps` timed steps after `--warmup`.
Each side times its own steps (perf_counter around each step, the loss read as a float every 10 steps as a logging
loop would) and prints its median; the sides alternate `--repeats` times; min / median / max of the ratios.

    python benchmarks/own_loop.py [--steps 300] [--warmup 30] [--repeats 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

COMMON = """
import statistics, sys, time, torch, torch.nn.functional as F
torch.manual_seed(0)
X, Y = torch.randn(4096, 64), torch.randint(0, 10, (4096,))
def mlp():
    return torch.nn.Sequential(torch.nn.Linear(64, 600), torch.nn.ReLU(), torch.nn.Linear(600, 600), torch.nn.ReLU(),
                               torch.nn.Linear(600, 10))
WARMUP, STEPS = int(sys.argv[1]), int(sys.argv[2])
CPU = []  # process CPU seconds (every thread: gloo's too) at the first timed step and after the last
def report(times, rank):
    if rank == 0:
        print(f"median_ms {statistics.median(times[WARMUP:]) * 1000:.4f}", flush=True)
        print(f"cpu_ms {(CPU[1] - CPU[0]) / STEPS * 1000:.4f}", flush=True)
def loop(model, opt, backward, rank):
    # the hand-written loop every peer runs, with its own backward (loss.backward, acc.backward, ...)
    g = torch.Generator().manual_seed(rank)
    times = []
    for step in range(WARMUP + STEPS):
        if step == WARMUP:
            CPU.append(time.process_time())
        t0 = time.perf_counter()
        idx = torch.randint(0, len(X), (32,), generator=g)
        loss = F.cross_entropy(model(X[idx]), Y[idx])
        backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0:
            float(loss)
        times.append(time.perf_counter() - t0)
    CPU.append(time.process_time())
    report(times, rank)
"""

SIDES = {
    "torchrun": """
import torch.distributed as dist
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(mlp())
loop(model, torch.optim.AdamW(model.parameters(), lr=1e-3), lambda loss: loss.backward(), dist.get_rank())
dist.destroy_process_group()
""",
    "plait": """
import plait
data = torch.utils.data.TensorDataset(X, Y)
p = plait.parallelize(mlp(), loss=F.cross_entropy, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
times = []
it = p.batches(data)
for step in range(WARMUP + STEPS):
    if step == WARMUP:
        CPU.append(time.process_time())
    t0 = time.perf_counter()
    out = p.step(next(it))
    if step % 10 == 0:
        out.loss
    times.append(time.perf_counter() - t0)
CPU.append(time.process_time())
report(times, 0 if p.is_main else 1)
p.close()
""",
    "accelerate": """
from accelerate import Accelerator
acc = Accelerator(cpu=True)
net = mlp()
model, opt = acc.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
loop(model, opt, acc.backward, acc.process_index)
""",
    "fabric": """
from lightning.fabric import Fabric
fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()
net = mlp()
model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
loop(model, opt, fabric.backward, fabric.global_rank)
""",
}
NEEDS = {"accelerate": "accelerate", "fabric": "lightning"}


def command(side: str, script: Path, warmup: int, steps: int, work: Path) -> list[str]:
    args = [str(script), str(warmup), str(steps)]
    if side == "plait":
        return [str(Path(sys.executable).parent / "plait"), "launch", "--set", "parallel.dp=2", "--set",
                f"train.steps={warmup + steps}", "--set", "train.global_batch_size=64", "--set",
                "train.micro_batch_size=32", "--out", str(work / "plait-run"), *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]


def run_side(side: str, work: Path, warmup: int, steps: int, cpu: bool = False) -> float | tuple[float, float]:
    """Rank 0's median step time (s); with cpu, also its process CPU seconds per timed step."""
    script = work / f"loop_{side}.py"  # not plait.py: the script's folder comes first on sys.path
    script.write_text(COMMON + SIDES[side])
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    for leftover in (work / "plait-run").glob("*"):
        leftover.unlink() if leftover.is_file() else None
    r = subprocess.run(command(side, script, warmup, steps, work), capture_output=True, text=True, env=env,
                       timeout=900)
    got = {line.split()[0]: float(line.split()[1]) / 1000 for line in r.stdout.splitlines()
           if line.startswith(("median_ms ", "cpu_ms "))}
    if r.returncode != 0 or len(got) < 2:
        raise SystemExit(f"{side} failed (exit {r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
    return (got["median_ms"], got["cpu_ms"]) if cpu else got["median_ms"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    sides = ["torchrun", "plait"] + [s for s, mod in NEEDS.items() if importlib.util.find_spec(mod) is not None]
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; sides: {', '.join(sides)}")
    results: dict[str, list[float]] = {s: [] for s in sides}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeats):
            order = sides if i % 2 == 0 else sides[::-1]
            for side in order:
                results[side].append(run_side(side, Path(tmp), a.warmup, a.steps))
                print(f"repeat {i + 1} {side:10} {results[side][-1] * 1000:.3f} ms/step", flush=True)
    print(f"\n{'side':12}{'ms/step':>10}{'ratio min':>11}{'median':>8}{'max':>8}   (ratio: each repeat over torchrun's)")
    for side in sides:
        ratios = [x / b for x, b in zip(results[side], results["torchrun"])]
        print(f"{side:12}{statistics.median(results[side]) * 1000:10.3f}{min(ratios):11.3f}"
              f"{statistics.median(ratios):8.3f}{max(ratios):8.3f}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; target plait / torchrun <= 1.02")


if __name__ == "__main__":
    main()
