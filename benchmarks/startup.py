"""Start-up: how long `plait train` takes to its first step, against bare torchrun reaching its own first step.

Each phase is timed from outside, as a user waits for it, from stdout lines as they arrive:

    import torch        `python -c "import torch"`: what every fresh process pays at least
    plait --help        the CLI alone (it imports no torch)
    job check           `plait train --dry-run`: config, layout and job check, no workers
    header              `plait train` (the default job, 2 steps) until its header line: the workers are up
    first step          ... until `step 1/2`: the number the target is about (<= 8 s on 2 cores)
    exit                ... until the process ends (final evaluation, sample, checkpoint, report)
    torchrun 1st step   baseline: `torchrun --standalone --nproc-per-node 2` of a DDP script that builds a model of the
                        same size and prints after its first step (no data, no checks, no checkpoint)

The default job's tokens are cached (~/.cache/plait, or $PLAIT_CACHE): the warm runs use one cache, the cold run a
fresh one, which pays for tokenizing the standard library once. Runs alternate `--repeats` times; min / median / max.

    python benchmarks/startup.py [--repeats 3] [--no-cold]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

TARGET_S = 8.0
BIN = Path(sys.executable).parent

BARE = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    from torch import nn
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(128, 4, 512, batch_first=True)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Embedding(256, 128), nn.TransformerEncoder(layer, 4),
                                                              nn.Linear(128, 256)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (16, 128))
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
    loss.backward(); opt.step()
    if dist.get_rank() == 0:
        print("step 1", flush=True)
    dist.destroy_process_group()
""")


def timed(cmd: list[str], marks: dict[str, str], env: dict) -> dict[str, float]:
    """Seconds from start until the first stdout line starting with each mark, and until exit ('exit')."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    seen: dict[str, float] = {}
    lines = []
    for line in proc.stdout:
        lines.append(line)
        for name, prefix in marks.items():
            if name not in seen and line.startswith(prefix):
                seen[name] = time.perf_counter() - t0
    if proc.wait() != 0 or len(seen) < len(marks):
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{''.join(lines[-20:])}")
    seen["exit"] = time.perf_counter() - t0
    return seen


def one_round(work: Path, cache: Path, n: int) -> dict[str, float]:
    env = dict(os.environ, PLAIT_CACHE=str(cache), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    row = {"import torch": timed([sys.executable, "-c", "import torch"], {}, env)["exit"],
           "plait --help": timed([str(BIN / "plait"), "--help"], {}, env)["exit"],
           "job check": timed([str(BIN / "plait"), "train", "--dry-run", "--out", str(work / f"dry{n}")], {}, env)["exit"]}
    run = timed([str(BIN / "plait"), "train", "--set", "train.steps=2", "--out", str(work / f"run{n}")],
                {"header": "plait: ", "first step": "step 1/"}, env)
    row.update(header=run["header"], **{"first step": run["first step"]}, exit=run["exit"])
    script = work / "bare.py"
    script.write_text(BARE)
    row["torchrun 1st step"] = timed([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                      "--nproc-per-node", "2", str(script)], {"s": "step 1"}, env)["s"]
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-cold", action="store_true", help="skip the run with an empty token cache")
    args = ap.parse_args(argv)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        warm = work / "cache-warm"
        timed([str(BIN / "plait"), "train", "--set", "train.steps=1", "--set", "log.report=false", "--out",
               str(work / "fill")], {}, dict(os.environ, PLAIT_CACHE=str(warm)))  # fills the warm cache
        rows = [one_round(work, warm, n) for n in range(args.repeats)]
        cold = None if args.no_cold else one_round(work, work / "cache-cold", args.repeats)
    print(f"\n{'phase (s from start)':<22}{'min':>8}{'median':>8}{'max':>8}" + ("   cold cache" if cold else ""))
    for name in rows[0]:
        vals = [r[name] for r in rows]
        print(f"{name:<22}{min(vals):8.2f}{statistics.median(vals):8.2f}{max(vals):8.2f}"
              + (f"{cold[name]:13.2f}" if cold else ""))
    first = statistics.median(r["first step"] for r in rows)
    ratio = first / statistics.median(r["torchrun 1st step"] for r in rows)
    print(f"\ntime to first step (warm cache): {first:.2f} s, target <= {TARGET_S:.0f} s: "
          f"{'met' if first <= TARGET_S else 'NOT met'}; plait / bare torchrun = {ratio:.2f}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
