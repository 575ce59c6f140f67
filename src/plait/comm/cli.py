"""`plait bench collectives`: argument parsing only (registered in plait.cli.VERB_MODULES); it runs in
plait.comm.commands."""

from __future__ import annotations

from pathlib import Path


def add_parsers(sub, bench) -> None:
    """Add `collectives` to `plait bench` (no top-level verbs)."""
    c = bench.add_parser("collectives", help="nccl-tests-style table of collectives: time, algbw, busbw per size and algorithm",
                         description="Time collectives on local gloo ranks (NCCL under torchrun on GPUs is not driven "
                                     "from here); print size, time, algbw and busbw, write collectives.csv and .png.")
    c.add_argument("--ops", default="allreduce", help="comma-separated: allreduce, allgather, reduce_scatter, broadcast, alltoall")
    c.add_argument("--algos", default="native,ring,tree",
                   help="comma-separated: native (torch.distributed), ring, tree (halving-doubling; binomial for broadcast), "
                        "hierarchical (allreduce)")
    c.add_argument("--sizes", default="1K:64M", help="MIN:MAX (times --factor each step) or a list such as 1K,1M")
    c.add_argument("--factor", type=int, default=2, help="size multiplier between steps of a MIN:MAX range")
    c.add_argument("--ranks", type=int, default=2, help="local processes (2-8)")
    c.add_argument("--iters", type=int, default=20, help="timed calls per trial (fewer when one call is slow)")
    c.add_argument("--warmup", type=int, default=3, help="untimed calls per point")
    c.add_argument("--repeats", type=int, default=5,
                   help="timed trials per point, the algorithms taking turns; the table gives the median and min-max")
    c.add_argument("--max-seconds", type=float, default=1.0, help="time budget per trial (at least 2 calls are timed)")
    c.add_argument("--local-size", type=int, default=0, help="hierarchical: ranks per node (0: half the ranks)")
    c.add_argument("--out", type=Path, help="where collectives.csv and .png go (default: runs/bench-collectives-<time>)")
    c.set_defaults(fn="plait.comm.commands:cmd_bench_collectives")
