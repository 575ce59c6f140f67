"""The three connectors of a small vision-language model, trained whole and with the language model frozen.

    python benchmarks/multimodal.py [--steps 800] [--width 64]

Per connector (model.connector: projection, cross_attention, qformer), on data.name = "digit-captions":
* whole: encoder, connector and language model trained together for --steps;
* frozen LM: first the language model alone learns the captions (--steps / 2, finetune.freeze = encoder and
  connector; a cross-attention model's closed gates make that the plain LM), then from those weights
  (train.init_from) the encoder and connector train for --steps with finetune.freeze = ["lm.*"].
Each row: caption loss on the validation split, zero-shot accuracy (the digit word the LM finds likeliest after
"a handwritten", no classifier trained) and trainable parameters, from summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BIN = Path(sys.executable).parent


def train(run: Path, sets: list[str]) -> dict:
    subprocess.run([str(BIN / "plait"), "train", *[x for s in sets for x in ("--set", s)], "--out", str(run)],
                   check=True, capture_output=True)
    return json.loads((run / "summary.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--width", type=int, default=64)
    a = ap.parse_args()
    base = ["data.name=digit-captions", "model.name=vlm", f"model.width={a.width}", "model.heads=4", "model.layers=2",
            "parallel.dp=1", "train.eval_every=0", "train.eval_samples=512", "log.progress=false", "log.report=false"]
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for connector in ("projection", "cross_attention", "qformer"):
            sets = [*base, f"model.connector={connector}"]
            whole = train(Path(d) / f"{connector}-whole", [*sets, f"train.steps={a.steps}"])
            text = Path(d) / f"{connector}-lm"
            train(text, [*sets, f"train.steps={a.steps // 2}", "finetune.freeze=['encoder.*', 'connector.*']"])
            frozen = train(Path(d) / f"{connector}-frozen", [*sets, f"train.steps={a.steps}", f"train.init_from={text}",
                                                               "finetune.freeze=['lm.*']"])
            for name, s in (("whole", whole), ("frozen LM", frozen)):
                m = s["multimodal"]
                rows.append((connector, name, s["val_loss"], m["zero_shot_accuracy"], m["trainable_params"], s["params"]))
    print(f"load average {os.getloadavg()[0]:.2f}; vlm width {a.width}, 2 LM blocks, {a.steps} steps, batch 32, "
          "AdamW, one process; 512 validation samples")
    print("\n| connector | trained | caption val loss | zero-shot accuracy | trainable / all params |\n"
          "|---|---|---:|---:|---:|")
    for connector, name, loss, acc, trainable, total in rows:
        print(f"| {connector} | {name} | {loss:.4f} | {acc:.3f} | {trainable:,} / {total:,} |")


if __name__ == "__main__":
    main()
