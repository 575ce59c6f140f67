"""`plait compat`: the technique x layout matrix comes from the job check itself, and docs/compat.md is its output."""

from __future__ import annotations

import re
from pathlib import Path

from plait.plan.compat import LAYOUTS, TECHNIQUES, Cell, markdown, matrix, rule

DOC = Path(__file__).resolve().parents[2] / "docs" / "compat.md"
BEGIN, END = "<!-- compat: begin (plait compat --markdown) -->", "<!-- compat: end -->"


def test_docs_hold_the_current_matrix_and_cells_are_the_job_checks_verdicts():
    cells = matrix()
    text = DOC.read_text()
    shown = text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()
    assert shown == markdown(cells).strip(), "docs/compat.md is stale: regenerate it with `plait compat --markdown`"
    # a few cells whose verdict the schemes' own tests pin down
    assert cells[("plain SGD/AdamW", "cp2 + ZeRO-3")] == Cell(True)
    assert cells[("LoRA", "tp2")] == Cell(True)  # each adapter split as its weight (tests/parallel/test_lora_tp.py)
    assert cells[("LoRA", "ep2")] == Cell(True)  # frozen experts stay frozen when ep shards them
    assert cells[("progressive freeze", "ep2")] == Cell(True)  # the dense part's DDP rebuilt at each freeze
    assert cells[("progressive freeze", "pp2")] == Cell(True)  # each stage freezes its blocks on the model's schedule
    assert cells[("mixture of experts", "tp2")] == Cell(True)  # experts whole on every tp rank
    assert cells[("adamw8bit", "ZeRO-1")] == Cell(True)  # ZeRO-1 owns whole tensors
    assert cells[("adamw8bit", "ZeRO-3")] == Cell(True)  # each rank's shard quantized in its own blocks
    assert cells[("adamw8bit", "tp2")] == Cell(True)  # tp's shards too
    assert cells[("PowerSGD", "tp2")].reason == ("parallel.compression = 'powersgd' compresses the gradients' "
                                                 "data-parallel reduction, and parallel.dp = 1 has none (no replicas "
                                                 "to average over)")
    assert len(cells) == len(TECHNIQUES) * len(LAYOUTS)


def test_a_rule_is_the_same_whichever_cell_meets_it():
    a = ("parallel.compression = 'fp16' runs as a DDP communication hook: it needs parallel.dp >= 2 with tp = pp = ep = 1, "
         "zero = 0 and no embedding_sharding (here dp = 1, tp = 2, pp = 1, ep = 1, zero = 0, sync = 'allreduce'); set "
         "parallel.compression='none' or change the layout")
    b = re.sub(r"tp = 2", "tp = 1", a).replace("zero = 0, sync", "zero = 3, sync")
    assert rule(a) == rule(b) == ("parallel.compression = 'fp16' runs as a DDP communication hook: it needs parallel.dp >= 2 "
                                  "with tp = pp = ep = 1, zero = 0 and no embedding_sharding")
