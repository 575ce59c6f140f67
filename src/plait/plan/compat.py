"""Which technique composes with which layout: the matrix, generated from the checks every job goes through.

    plait compat              # techniques x layouts on the default GPT job: ✔, or ✘ and the one-line reason
    plait compat --markdown   # the same as a Markdown table (docs/compat.md is this, and a test keeps it current)

Nothing here is written by hand but the two lists below: each cell is `plait.train.job.check_job` on the default job
with the layout's and the technique's keys, the check `plait train` runs before any worker starts, made of each
scheme's own rules (plait.parallel.*) and each technique's (plait.finetune, plait.train). A cell is ✔ when the job
check accepts the pair, which is what `plait train` would then run; otherwise it shows the rule the user meets.
Every accepted cell is tested: tests/plan/test_compat_cells.py names each cell's test or runs the cell itself.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from plait.config import dump_config, load_config
from plait.errors import ConfigError
from plait.train.job import check_job

# (name, --set overrides): what a user adds to a job to use the technique
TECHNIQUES: list[tuple[str, tuple[str, ...]]] = [
    ("plain SGD/AdamW", ()),
    ("activation checkpointing", ("train.activation_checkpointing=true",)),
    ("LoRA", ("finetune.lora_rank=4",)),
    ("QLoRA (nf4 base)", ("finetune.lora_rank=4", "finetune.quantize_base='nf4'")),
    ("freeze", ("finetune.freeze=['blocks.0.*']",)),
    ("progressive freeze", ("finetune.progressive_freeze=true",)),
    ("mixture of experts", ("model.moe_experts=4",)),
    ("adamw8bit", ("optim.name='adamw8bit'",)),
    ("LAMB", ("optim.name='lamb'",)),
    ("fp16 compression", ("parallel.compression='fp16'",)),
    ("PowerSGD", ("parallel.compression='powersgd'",)),
    ("top-k compression", ("parallel.compression='topk'",)),
    ("optimizer offload (disk)", ("parallel.offload='disk'",)),
    ("fp16 loss scaling", ("precision.dtype='fp16'",)),
    ("distillation", ("distill.teacher='{teacher}'",)),  # a run folder made for the check (its config only)
]

# (name, --set overrides): the layouts, from one process to the hybrids (ep needs experts: the layout brings them)
LAYOUTS: list[tuple[str, tuple[str, ...]]] = [
    ("1 process", ("parallel.dp=1",)),
    ("dp2", ("parallel.dp=2",)),
    ("ZeRO-1", ("parallel.dp=2", "parallel.zero=1")),
    ("ZeRO-2", ("parallel.dp=2", "parallel.zero=2")),
    ("ZeRO-3", ("parallel.dp=2", "parallel.zero=3")),
    ("tp2", ("parallel.dp=1", "parallel.tp=2")),
    ("pp2", ("parallel.dp=1", "parallel.pp=2")),
    ("dp2 x tp2", ("parallel.dp=2", "parallel.tp=2")),
    ("pp2 + ZeRO-3", ("parallel.dp=2", "parallel.pp=2", "parallel.zero=3")),
    ("pp2 x tp2", ("parallel.dp=1", "parallel.pp=2", "parallel.tp=2")),
    ("ep2", ("parallel.dp=2", "parallel.ep=2", "model.moe_experts=4")),
    ("cp2", ("parallel.dp=1", "parallel.cp=2")),
    ("cp2 + ZeRO-3", ("parallel.dp=1", "parallel.cp=2", "parallel.zero=3")),
]


@dataclass(frozen=True)
class Cell:
    ok: bool
    reason: str = ""  # the refusal's first clause ("" when ok)


def cell(layout: tuple[str, ...], technique: tuple[str, ...], base: tuple[str, ...] = ()) -> Cell:
    """The job check on the default job with these overrides."""
    try:
        check_job(load_config(None, [*base, *layout, *technique]), user_data=False)
    except ConfigError as e:
        return Cell(False, rule(str(e)))
    return Cell(True)


def rule(message: str) -> str:
    """A refusal's rule, the same in every cell it refuses: its first clause (errors say the rule, then '; ' and the
    fix), without the '(here dp = 2, ...)' that names the cell's degrees."""
    first = message.split("; ")[0].split("\n")[0]
    return re.sub(r" \(here [^)]*\)", "", first).strip()


def matrix(base: tuple[str, ...] = ()) -> dict[tuple[str, str], Cell]:
    """{(technique, layout): Cell} for every pair."""
    with tempfile.TemporaryDirectory(prefix="plait-compat-") as tmp:
        teacher = Path(tmp) / "teacher"
        teacher.mkdir()
        (teacher / "config.toml").write_text(dump_config(load_config(None, list(base))))
        return {(t, lay): cell(lo, tuple(o.format(teacher=teacher) for o in to), base)
                for t, to in TECHNIQUES for lay, lo in LAYOUTS}


def markdown(cells: dict[tuple[str, str], Cell]) -> str:
    """The matrix as Markdown: ✔ or ✘ with a footnote number; the reasons listed below the table, each once."""
    reasons: list[str] = []
    head = "| technique | " + " | ".join(lay for lay, _ in LAYOUTS) + " |"
    lines = [head, "|---|" + "---|" * len(LAYOUTS)]
    for t, _ in TECHNIQUES:
        row = []
        for lay, _ in LAYOUTS:
            c = cells[(t, lay)]
            if c.ok:
                row.append("✔")
                continue
            if c.reason not in reasons:
                reasons.append(c.reason)
            row.append(f"✘ {reasons.index(c.reason) + 1}")
        lines.append(f"| {t} | " + " | ".join(row) + " |")
    ok = sum(c.ok for c in cells.values())
    lines += ["", f"{ok} of {len(cells)} cells compose.", ""]
    lines += [f"{i}. {r}" for i, r in enumerate(reasons, 1)]
    return "\n".join(lines) + "\n"


def text(cells: dict[tuple[str, str], Cell]) -> str:
    """The matrix for a terminal: one row a technique, ✔ or the footnote number; the reasons below."""
    width = max(len(t) for t, _ in TECHNIQUES)
    cols = [max(len(lay), 4) for lay, _ in LAYOUTS]
    reasons: list[str] = []
    out = [" " * width + "  " + "  ".join(lay.rjust(w) for (lay, _), w in zip(LAYOUTS, cols))]
    for t, _ in TECHNIQUES:
        marks = []
        for (lay, _), w in zip(LAYOUTS, cols):
            c = cells[(t, lay)]
            if not c.ok and c.reason not in reasons:
                reasons.append(c.reason)
            marks.append(("✔" if c.ok else f"✘{reasons.index(c.reason) + 1}").rjust(w))
        out.append(t.ljust(width) + "  " + "  ".join(marks))
    ok = sum(c.ok for c in cells.values())
    out += ["", f"{ok} of {len(cells)} cells compose; ✘n: refused, for reason n:"]
    out += [f"  {i}. {r}" for i, r in enumerate(reasons, 1)]
    return "\n".join(out) + "\n"


def cmd_compat(a) -> int:
    """`plait compat`'s verb (its parser: plait.plan.cli)."""
    cells = matrix()
    print(markdown(cells) if a.markdown else text(cells), end="")
    return 0
