"""`plait cluster run` and `plait cluster simulate`: a queue of jobs under a scheduling policy, real or simulated.

    plait cluster run JOBS.toml --slots 4 --policy tiresias [--quantum 30] [--out DIR]

    plait cluster simulate --synthetic 1000 --devices 64 [--policy all] [--load 0.9] [--seed 0] [--out DIR]
    plait cluster simulate --trace jobs.csv --devices 16 --policy fifo,tiresias --quantum 360 --switch-cost 10

The parsers only; the verbs run in plait.cluster.commands.
"""

from __future__ import annotations

from pathlib import Path

from plait.cluster.policies import POLICIES, Params

# What the papers report against FIFO / YARN-CS on their own traces (for the table's last column; not our measure).
PAPERS = {"tiresias": "avg JCT up to 5.5x better than YARN-CS (Gu et al., NSDI'19)",
          "gandiva": "+26 % cluster utilisation from time-slicing and packing (Xiao et al., OSDI'18)",
          "srtf": "the oracle bound Tiresias compares with (needs job lengths in advance)", "fifo": "baseline"}


def _policy_flags(p) -> None:
    p.add_argument("--quantum", type=float, default=Params().quantum,
                   help=f"seconds: gandiva's shortest turn (default {Params().quantum:g})")
    p.add_argument("--thresholds", help="tiresias: queue boundaries in device-seconds, comma separated "
                                        f"(default {','.join(str(t) for t in Params().thresholds)})")
    p.add_argument("--promote", type=float, default=Params().promote,
                   help="tiresias: a job that waited longer than this x its run time returns to the top queue "
                        f"(default {Params().promote:g})")


def add_parsers(sub, bench) -> None:
    c = sub.add_parser("cluster", help="share a cluster among plait jobs: scheduling policies and their simulator")
    csub = c.add_subparsers(dest="cluster_cmd", required=True)
    r = csub.add_parser("run", help="run a queue of plait jobs on this machine's process slots under a policy")
    r.add_argument("jobs", type=Path, help="JOBS.toml: [[job]] tables (name, config, set, arrival, min/max_procs)")
    r.add_argument("--slots", type=int, required=True,
                   help="worker processes this machine runs at once (--backend slurm: nodes, one process each)")
    r.add_argument("--backend", choices=("local", "slurm"), default="local",
                   help="local: processes on this machine (default); slurm: each run an sbatch job of `plait slurm`, "
                        "preempted by USR1 (checkpoint, end) and resubmitted at the size the policy gives")
    r.add_argument("--time", default="01:00:00", help="--backend slurm: each submission's --time (default 01:00:00)")
    r.add_argument("--partition", default="", help="--backend slurm: the partition to submit to (default: Slurm's)")
    r.add_argument("--policy", default="fifo", help=f"one of {', '.join(POLICIES)} (default fifo)")
    _policy_flags(r)
    r.add_argument("--poll", type=float, default=0.5, help="seconds between looks at the queue (default 0.5)")
    r.add_argument("--timeout", type=float, default=3600.0, help="seconds: give up (every job checkpoints) after this long "
                                                                "(default 3600)")
    r.add_argument("--out", help="the jobs' run dirs, cluster.json and gantt.png (default: runs/cluster-<time>)")
    r.set_defaults(fn="plait.cluster.commands:cmd_run")
    s = csub.add_parser("simulate", help="replay a trace of jobs under scheduling policies (simulated clock)")
    s.add_argument("--trace", type=Path, help="CSV with arrival,devices,duration[,id] per job (seconds)")
    s.add_argument("--synthetic", type=int, metavar="N", help="draw N jobs (Poisson arrivals, heavy-tailed lengths)")
    s.add_argument("--devices", type=int, required=True, help="device slots in the cluster")
    s.add_argument("--policy", default="all", help=f"all (the default), or a comma list of {', '.join(POLICIES)}")
    _policy_flags(s)
    s.add_argument("--switch-cost", type=float, default=10.0,
                   help="seconds a preempted job spends restoring its checkpoint when it runs again (default 10)")
    s.add_argument("--load", type=float, default=0.9, help="--synthetic: offered load as a fraction of the devices (default 0.9)")
    s.add_argument("--seed", type=int, default=0, help="--synthetic: random seed (default 0)")
    s.add_argument("--out", help="write results.json, trace.csv and jct_cdf.png here")
    s.set_defaults(fn="plait.cluster.commands:cmd_simulate")
