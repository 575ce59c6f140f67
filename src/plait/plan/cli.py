"""`plait plan` and `plait simulate`: which layout to run, and how it scales, before the job starts.

    plait plan [CONFIG] --devices N [--device-memory 80GB] [--device-flops 989e12]
               [--link-bandwidth 400Gbps,25Gbps] [--devices-per-node 8] [--top 10] [--out DIR]
    plait plan [CONFIG] --calibrate [--world 2]       # measure this machine; later plans use it
    plait simulate [CONFIG] --devices 1024 [--set-layout tp=8,pp=1] [...hardware flags]

The parsers of plan, simulate, compat and whatif only; the verbs run in plait.plan.commands (the cost model and
the search, which import torch), plait.plan.compat and plait.plan.whatif.
"""

from __future__ import annotations

from pathlib import Path

from plait.plan.whatif import CHANGES


def _hardware_flags(p, what: str) -> None:
    p.add_argument("--device-memory", help="memory per device, e.g. 80GB (default: 80GB, or the calibration file's)")
    p.add_argument("--device-flops", help="peak FLOP/s per device in the training dtype, e.g. 989e12 (default: 989e12, "
                                          "or the calibration file's)")
    p.add_argument("--link-bandwidth", help="inside a node,across nodes, e.g. 400Gbps,25Gbps (the default)")
    p.add_argument("--devices-per-node", type=int, help="devices that share the fast in-node links (default: 8)")
    p.add_argument("--profile", help="device profile JSON to use (default: ~/.cache/plait/device_profile.json when "
                                     "`plait plan --calibrate` wrote it and no hardware flag is given)")
    p.add_argument("--out", help=f"folder for the PNG (default: runs/{what}-<time>)")


CONFIG_HELP = "the job's TOML config (default: the built-in default job); its model and global batch are planned"
SET_HELP = "override a config key, as for plait train (repeatable)"


def add_parsers(sub, bench) -> None:
    c = sub.add_parser("compat", help="which technique composes with which layout: the matrix plait's own checks give")
    c.add_argument("--markdown", action="store_true", help="print a Markdown table (docs/compat.md is its output)")
    c.set_defaults(fn="plait.plan.compat:cmd_compat")
    w = sub.add_parser("whatif", help="predict a change's step time from a profiled step, without running it")
    w.add_argument("run_dir", type=Path, help="a run trained with log.profile_steps")
    w.add_argument("--change", action="append", required=True, metavar="CHANGE",
                   help=f"what to simulate: {', '.join(CHANGES)} (repeat for several)")
    w.add_argument("--rank", type=int, default=0, help="whose trace (default: 0)")
    w.set_defaults(fn="plait.plan.whatif:cmd_whatif")
    p = sub.add_parser("plan", help="rank every layout for N devices by predicted step time and memory")
    p.add_argument("config", nargs="?", help=CONFIG_HELP)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help=SET_HELP)
    p.add_argument("--devices", type=int, help="devices available; layouts on all of them, and on fewer when a small "
                                               "model runs faster so, are ranked")
    p.add_argument("--top", type=int, default=10, help="layouts shown (default: 10)")
    p.add_argument("--calibrate", action="store_true", help="measure this machine and write the calibration file "
                                                            "~/.cache/plait/device_profile.json (or --profile)")
    p.add_argument("--world", type=int, default=2, help="--calibrate: local processes to measure (default: 2)")
    _hardware_flags(p, "plan")
    p.set_defaults(fn="plait.plan.commands:cmd_plan")
    s = sub.add_parser("simulate", help="project step time, MFU and scaling efficiency up to many devices")
    s.add_argument("config", nargs="?", help=CONFIG_HELP)
    s.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help=SET_HELP)
    s.add_argument("--devices", type=int, required=True, help="the largest device count (doubling from 8 up to it)")
    s.add_argument("--layout", help="fix the model-parallel part, e.g. tp=8,pp=1 (keys tp, pp, zero, micro, ac; "
                                    "default: the planner's best at each size)")
    s.add_argument("--weak", action="store_true", help="grow the global batch with the data-parallel degree")
    _hardware_flags(s, "simulate")
    s.set_defaults(fn="plait.plan.commands:cmd_simulate")
