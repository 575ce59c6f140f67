"""Verbs for running on a cluster (loaded by plait.cli through VERB_MODULES).

    plait env [CONFIG] [--set ...] [--json]
    plait slurm [CONFIG] --nodes N --gpus-per-node G --cpus-per-task C --time HH:MM:SS [--partition P] [--account A]
                [--set k=v ...] --out RUN_DIR [--submit]
    plait k8s [CONFIG] --nodes N --nproc-per-node P --image IMAGE [--kind pytorchjob|trainjob|jobset]
              [--elastic MIN:MAX] [--gpus-per-node G] [--pvc NAME] [--set ...]
    plait k8s serve RUN_DIR --image IMAGE [--pvc NAME] [--min-replicas N] [--kserve]
    plait launch [--set ...] [--out DIR] [CONFIG] script.py [args...]     (plait.launch.script)

Bad flags exit 2 naming the flag (argparse's own message for types and ranges). The verbs run in
plait.launch.commands, imported when one of them runs; the checks of --time, --image and --elastic are the Slurm and
Kubernetes front ends' own, imported when such a flag is read.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from plait.errors import ConfigError
from plait.refs import later


def _at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
        return value

    return parse


def _checked(check, keep_text: bool = False):
    """An argparse type from a check that raises ConfigError; keep_text: the flag's value is the text it checked."""
    def parse(text: str):
        try:
            value = check(text)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text if keep_text else value

    return parse


_TIME = _checked(later("plait.launch.slurm:parse_time"), keep_text=True)  # the Slurm front end's own check
_IMAGE = _checked(later("plait.launch.k8s:check_image"))  # the Kubernetes front end's
_ELASTIC = _checked(later("plait.launch.k8s:parse_elastic"))


def add_parsers(sub, bench) -> None:
    e = sub.add_parser("env", help="what the workload manager's environment says: rank, world size, master (torchrun, "
                                   "Slurm, Kubeflow, MPI, Ray)")
    e.add_argument("config", nargs="?", help="TOML config (decides whether plait train here is a worker or a launcher)")
    e.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    e.add_argument("--json", action="store_true", help="print JSON")
    e.set_defaults(fn="plait.launch.commands:cmd_env")

    s = sub.add_parser("slurm", help="write RUN_DIR/job.sbatch for a Slurm cluster (requeues itself on preemption)")
    s.add_argument("config", nargs="?", help="TOML config file (default: the built-in default job)")
    s.add_argument("--nodes", type=_at_least(1), required=True, help="nodes; one plait launcher on each")
    s.add_argument("--gpus-per-node", type=_at_least(0), default=0, help="GPUs (and worker processes) per node; 0: CPU, "
                                                                          "the layout's processes spread over the nodes")
    s.add_argument("--cpus-per-task", type=_at_least(1), required=True, help="CPUs for each node's task")
    s.add_argument("--time", type=_TIME, required=True, help="time limit, HH:MM:SS (or any form sbatch takes)")
    s.add_argument("--partition", help="Slurm partition")
    s.add_argument("--account", help="Slurm account")
    s.add_argument("--job-name", help="job name (default: plait-<run dir name>)")
    s.add_argument("--grace", type=_at_least(1), default=120,
                   help="seconds before the time limit at which the job checkpoints and requeues itself (default 120)")
    s.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    s.add_argument("--out", required=True, help="the run dir, on storage every node sees")
    s.add_argument("--submit", action="store_true", help="sbatch it and print the job id")
    s.set_defaults(fn="plait.launch.commands:cmd_slurm")

    k = sub.add_parser("k8s", help="print Kubernetes manifests: a training job (PyTorchJob, TrainJob, JobSet) or serving",
                       description="plait k8s [CONFIG] --nodes N --nproc-per-node P --image IMAGE ...   a training job\n"
                                   "plait k8s serve RUN_DIR --image IMAGE [--pvc NAME] ...          serving",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    k.add_argument("args", nargs="*", metavar="CONFIG | serve RUN_DIR",
                   help="a training config, or `serve RUN_DIR` for a model server")
    k.add_argument("--image", type=_IMAGE, required=True, help="container image with plait installed")
    k.add_argument("--nodes", type=_at_least(1), help="pods (nodes) of the training job")
    k.add_argument("--nproc-per-node", type=_at_least(1), help="worker processes per pod")
    k.add_argument("--kind", choices=("pytorchjob", "trainjob", "jobset"), help="the training job's kind (default pytorchjob)")
    k.add_argument("--elastic", type=_ELASTIC, metavar="MIN:MAX", help="PyTorchJob elasticPolicy: go on with MIN "
                                                                                 "to MAX pods")
    k.add_argument("--gpus-per-node", type=_at_least(0), default=0, help="nvidia.com/gpu per pod")
    k.add_argument("--pvc", help="PersistentVolumeClaim for run dirs, mounted at /plait (ReadWriteMany for several pods)")
    k.add_argument("--name", help="job or service name (default plait-job / plait-serve)")
    k.add_argument("--namespace", help="namespace for every object")
    k.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    k.add_argument("--min-replicas", type=_at_least(0), default=1, help="serve: replicas at least (0 with --kserve: scale "
                                                                        "to zero)")
    k.add_argument("--max-replicas", type=_at_least(0), default=0, help="serve with --kserve: replicas at most")
    k.add_argument("--kserve", action="store_true", help="serve: a KServe InferenceService instead of a Deployment")
    k.set_defaults(fn="plait.launch.commands:cmd_k8s")

    la = sub.add_parser("launch", help="run your own script in the layout's processes (torchrun's agent); "
                                       "plait.parallelize(model) inside it applies the layout",
                        description="plait launch [--set SECTION.KEY=VALUE ...] [--out DIR] [CONFIG] script.py [args...]")
    la.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    la.add_argument("--out", type=Path, help="run directory for config.toml and logs (default: runs/launch-<time>)")
    la.add_argument("rest", nargs=argparse.REMAINDER, metavar="[CONFIG] script.py [args...]",
                    help="an optional config, your script and its own arguments")
    la.set_defaults(fn="plait.launch.script:cmd_launch")
