"""Fine-tuning the default GPT on another corpus: full, frozen half, LoRA, QLoRA, bottleneck adapters and a distilled
student, one table.

    pretrain   the default job's GPT (4 blocks, width 128, context 128) on the standard library's modules
               (Lib/*.py outside test/), --pretrain-steps steps
    fine-tune  on the standard library's own tests (Lib/test/test_*.py), --steps steps each, all starting from
               the pre-trained weights (train.init_from) except the students:
      full           every parameter trains
      freeze-half    finetune.freeze = tok_emb* (and the tied head), blocks 0 and 1
      progressive    finetune.progressive_freeze: blocks 0..3 freeze front to back from half-way (docs/finetune.md)
      lora-r8        finetune.lora_rank = 8 on q, v, up and down of every block (the rest frozen)
      qlora-nf4      the same with the adapted layers' base weights in NF4 (bitsandbytes; skipped if absent)
      adapters-h16   finetune.adapters: Houlsby bottleneck adapters of width 16 after every block's attention and
                     MLP output projections (the rest frozen)
      adapters-p16   the same after the MLP alone (Pfeiffer)
      student-alone  a half-width GPT (width 64) trained on the test corpus from scratch
      student-distill  the same student distilled from the full fine-tune (--alpha, --temperature)

Both corpora get the same character vocabulary (the benchmark writes copies whose non-ASCII characters
are replaced by '?', each with one comment line holding every printable ASCII character), so the
pre-trained embedding fits the fine-tuning data. Every run: --ranks gloo ranks (plait.testing.RankPool),
AdamW, the default schedule and clipping, global batch 32. The table: trainable parameters, optimizer
bytes and bytes sent per step on rank 0 (summary.json), mean step time over the run's training loop, and
the validation loss on the test corpus's held-out files.

    python benchmarks/finetune.py [--pretrain-steps 200] [--steps 100] [--ranks 2] [--tiny] [--out DIR]
                                  [--only student-alone,student-distill] [--alpha A] [--temperature T]

--tiny: a 2-block width-32 GPT with context 32, a few files and steps (a smoke run of every path).
--only: run these variants alone; with --out, a pre-training run (and the teacher, `full`) already there is reused.
--json: print the rows as one JSON line at the end (for tests and scripts).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import string
import sysconfig
import tempfile
from pathlib import Path

from plait.config import load_config
from plait.testing import RankPool

ALPHABET = "# " + "".join(c for c in string.printable if c not in "\r\x0b\x0c") + "\n"


def corpus(files: list[Path], out: Path) -> Path:
    out.mkdir(parents=True)
    for i, f in enumerate(files):
        text = f.read_text(encoding="utf-8", errors="replace")
        text = "".join(c if c in string.printable and c not in "\r\x0b\x0c" else "?" for c in text)
        (out / f"{i:04d}_{f.name}").write_text(ALPHABET + text)
    return out


def run(cfg, run_dir: Path):
    """Pool task: train; rank 0 returns summary.json's figures."""
    import torch.distributed as dist

    from plait.train.trainer import train

    s = train(cfg, run_dir).summary
    if dist.get_rank() != 0:
        return None
    return {"trainable": s["trainable_params"], "params": s["params"],
            "optimizer_bytes": s["memory"]["per_rank"][0]["optimizer_bytes"],
            "sent_per_step": s["comm"]["bytes_per_step_per_rank"][0],
            "step_s": s["train_time_s"] / s["steps"], "val_loss": s["val_loss"]}


def main(argv: list[str] | None = None, pool: RankPool | None = None) -> dict[str, dict]:
    """Run the benchmark; returns the table's rows. pool: ranks to reuse (a test's), else --ranks new ones."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pretrain-steps", type=int, default=200)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", type=Path, help="where the runs and finetune.json go (default: a temporary folder)")
    ap.add_argument("--only", default="", help="comma-separated variants to run (default: all)")
    ap.add_argument("--alpha", type=float, default=0.9, help="distill.alpha of the distilled student")
    ap.add_argument("--temperature", type=float, default=1.0, help="distill.temperature of the distilled student")
    ap.add_argument("--student-steps", type=int, default=0, help="steps of both students (default: --steps)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    lib = Path(sysconfig.get_paths()["stdlib"])
    modules = sorted(p for p in lib.glob("*.py"))
    tests = sorted((lib / "test").glob("test_*.py"))
    if a.tiny:
        modules, tests = modules[:6], tests[:6]
    root = a.out or Path(tempfile.mkdtemp(prefix="plait-finetune-"))
    pre_data, ft_data = corpus(modules, root / "corpus-modules"), corpus(tests, root / "corpus-tests")
    model = ["model.layers=2", "model.width=32", "model.heads=2", "model.context=32"] if a.tiny else []
    half = "model.width=16" if a.tiny else "model.width=64"
    common = [f"parallel.dp={a.ranks}", "data.name='text'", "data.min_char_count=1", "data.val_fraction=0.2",
              "log.progress=false", "log.report=false", "train.sample_tokens=0", "checkpoint.every=0", *model]
    if a.tiny:
        common += ["train.eval_samples=32", "train.global_batch_size=8", "train.micro_batch_size=4"]

    def cfg(data: Path, steps: int, *more: str):
        return load_config(None, [*common, f"data.path='{data}'", f"train.steps={steps}", *more])

    pre_steps, steps = (6, 4) if a.tiny else (a.pretrain_steps, a.steps)
    student_steps = a.student_steps or steps
    targets = "finetune.lora_targets=['*attn.q', '*attn.v', '*mlp.up', '*mlp.down']"
    rows: dict[str, dict] = {}
    half_blocks = "['tok_emb*', 'blocks.0.*']" if a.tiny else "['tok_emb*', 'blocks.0.*', 'blocks.1.*']"
    with contextlib.nullcontext(pool) if pool is not None else RankPool(a.ranks, timeout_s=3600) as pool:
        if not (root / "pretrain" / "summary.json").is_file():
            pool.run(run, cfg(pre_data, pre_steps), root / "pretrain")
        init = f"train.init_from='{root / 'pretrain'}'"
        variants = {
            "full": (init,),
            "freeze-half": (init, f"finetune.freeze={half_blocks}"),
            "progressive": (init, "finetune.progressive_freeze=true", "finetune.progressive_freeze_start=0.5"),
            "lora-r8": (init, "finetune.lora_rank=8", targets),
            "qlora-nf4": (init, "finetune.lora_rank=8", targets, "finetune.quantize_base='nf4'"),
            "adapters-h16": (init, "finetune.adapters={size=16, variant='houlsby'}"),
            "adapters-p16": (init, "finetune.adapters={size=16, variant='pfeiffer'}"),
            "student-alone": (half,),
            "student-distill": (half, f"distill.teacher='{root / 'full'}'", f"distill.alpha={a.alpha}",
                                f"distill.temperature={a.temperature}"),
        }
        chosen = [n for n in a.only.split(",") if n] or list(variants)
        unknown = sorted(set(chosen) - set(variants))
        if unknown:
            raise SystemExit(f"--only: unknown variants {unknown}; choose from {list(variants)}")
        if "student-distill" in chosen and "full" not in chosen and not (root / "full" / "config.toml").is_file():
            chosen.insert(0, "full")  # the teacher
        for name, more in variants.items():
            if name not in chosen:
                continue
            n_steps = student_steps if name.startswith("student") else steps
            if name == "qlora-nf4":
                try:
                    import bitsandbytes  # noqa: F401
                except ImportError:
                    print("qlora-nf4: skipped (pip install 'plait[qlora]')")
                    continue
            rows[name] = pool.run(run, cfg(ft_data, n_steps, *more), root / name)[0]
            print(f"{name}: val loss {rows[name]['val_loss']:.4f}", flush=True)
    head = f"{'run':<16} {'trainable':>10} {'optimizer B':>12} {'sent B/step':>12} {'step s':>8} {'val loss':>9}"
    print(f"\npre-trained {pre_steps} steps on {len(modules)} modules, fine-tuned {steps} steps on {len(tests)} test files, "
          f"{a.ranks} ranks; students {student_steps} steps, distilled with alpha {a.alpha}, temperature "
          f"{a.temperature}\n" + head)
    for name, r in rows.items():
        print(f"{name:<16} {r['trainable']:>10,} {r['optimizer_bytes']:>12,} {r['sent_per_step']:>12,.0f} "
              f"{r['step_s']:>8.3f} {r['val_loss']:>9.4f}")
    (root / "finetune.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{root / 'finetune.json'}")
    if a.json:
        print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
