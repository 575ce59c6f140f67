"""Chaos: N short 2-process jobs, each killed at a random step on a random rank (or mid-checkpoint), then recovered.

Each job trains the tiny GPT of the fault tests for --steps steps with a checkpoint every
--every steps and launch.max_restarts = 1; a SIGKILL is injected with PLAIT_FAULTS. The script
prints, per run and in total: whether it completed, the steps lost beyond the last checkpoint
(redone after the restart), whether any checkpoint failed verification, and the time the
recovery cost against an uninterrupted run measured in the same session.
Target: all completed, zero corrupt, steps lost <= the checkpoint interval.

    python benchmarks/chaos.py [--runs 20] [--steps 12] [--every 3] [--seed 0] [--out runs/chaos]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def job_file(out: Path, steps: int, every: int) -> Path:
    sys.path.insert(0, str(HERE.parent / "tests"))
    from helpers import TINY_GPT
    from plait.config import dump_config, load_config

    corpus = out / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    for name in ("textwrap.py", "string.py", "bisect.py", "heapq.py", "shlex.py", "glob.py", "copy.py"):
        (corpus / name).write_text((root / name).read_text())
    cfg = load_config(None, TINY_GPT + ["data.name='text'", f"data.path='{corpus}'", f"train.steps={steps}",
                                        f"checkpoint.every={every}", "checkpoint.keep=2", "log.every=1",
                                        "launch.max_restarts=1", "launch.timeout_s=60"])
    path = out / "job.toml"
    path.write_text(dump_config(cfg))
    return path


def run(job: Path, out: Path, faults: str) -> tuple[int, str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PLAIT_FAULTS": faults}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "plait", "train", str(job), "--out", str(out)], capture_output=True,
                       text=True, env=env, timeout=600)
    return r.returncode, r.stdout + r.stderr, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("runs/chaos"))
    a = ap.parse_args()
    from plait.errors import CheckpointError
    from plait.train.checkpoint import verify

    a.out.mkdir(parents=True, exist_ok=True)
    job = job_file(a.out, a.steps, a.every)
    code, text, base = run(job, a.out / "baseline", "")
    assert code == 0, text
    print(f"uninterrupted run: {base:.1f} s")
    rng = random.Random(a.seed)
    rows = []
    for i in range(a.runs):
        step, rank = rng.randint(2, a.steps), rng.randint(0, 1)
        at = rng.choice(["step", "step", "publish"]) if step % a.every == 0 else "step"
        if at == "publish":
            rank = 0  # rank 0 publishes
        faults = f"kill:rank={rank}:step={step}" + (":at=publish" if at == "publish" else "")
        code, text, wall = run(job, a.out / f"run{i:02d}", faults)
        summary_file = a.out / f"run{i:02d}" / "summary.json"
        steps_done = json.loads(summary_file.read_text()).get("steps") if summary_file.is_file() else None
        m = re.search(r"resuming from .* at step (\d+)", text)
        resumed = int(m.group(1)) if m else 0
        lost = (step - 1 if at == "step" else step) - resumed
        corrupt = 0
        for ckpt in (a.out / f"run{i:02d}" / "checkpoints").glob("step_*"):
            try:
                verify(ckpt)
            except CheckpointError:
                corrupt += 1
        rows.append({"run": i, "fault": faults, "completed": code == 0 and steps_done == a.steps, "lost": lost,
                     "corrupt": corrupt, "overhead_s": wall - base})
        r = rows[-1]
        print(f"run {i:2d}  {faults:34}  completed={r['completed']!s:5}  resumed at {resumed:2d}  lost {lost}  "
              f"corrupt {corrupt}  recovery +{r['overhead_s']:.1f} s", flush=True)
    done = sum(r["completed"] for r in rows)
    print(f"\n{done}/{len(rows)} runs completed; steps lost beyond the last checkpoint: max {max(r['lost'] for r in rows)}"
          f" (interval {a.every}), mean {sum(r['lost'] for r in rows) / len(rows):.2f}; corrupt checkpoints seen: "
          f"{sum(r['corrupt'] for r in rows)}; recovery overhead: mean {sum(r['overhead_s'] for r in rows) / len(rows):.1f} s "
          f"on a {base:.1f} s job")
    (a.out / "chaos.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
