"""Verbs for running on a cluster (loaded by plait.cli through VERB_MODULES).

    plait env [CONFIG] [--set ...] [--json]
    plait slurm [CONFIG] --nodes N --gpus-per-node G --cpus-per-task C --time HH:MM:SS [--partition P] [--account A]
                [--set k=v ...] --out RUN_DIR [--submit]
    plait k8s [CONFIG] --nodes N --nproc-per-node P --image IMAGE [--kind pytorchjob|trainjob|jobset]
              [--elastic MIN:MAX] [--gpus-per-node G] [--pvc NAME] [--set ...]
    plait k8s serve RUN_DIR --image IMAGE [--pvc NAME] [--min-replicas N] [--kserve]
    plait launch [--set ...] [--out DIR] [CONFIG] script.py [args...]     (plait.launch.script)

Bad flags exit 2 naming the flag (argparse's own message for types and ranges).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from plait.config import load_config
from plait.errors import ConfigError
from plait.launch.follow import follow_launch, pinned_dp
from plait.rundir import timestamped


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


def _checked(check):
    def parse(text: str):
        try:
            return check(text)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def _time(text: str) -> str:
    from plait.launch.slurm import parse_time  # lazily: each verb loads only its own module

    parse_time(text)
    return text


def _image(text: str) -> str:
    from plait.launch.k8s import check_image  # lazily: each verb loads only its own module

    return check_image(text)


def _elastic(text: str) -> tuple[int, int]:
    from plait.launch.k8s import parse_elastic  # lazily: each verb loads only its own module

    return parse_elastic(text)


def cmd_env(a) -> int:
    # lazily: `plait --help` loads this module for every verb
    from plait.launch.env import format_env, resolve  # lazily: plait --help must not import torch
    from plait.launch.role import describe, job_role  # lazily: plait --help must not import torch

    env = resolve()  # partial or contradictory variables: an error naming them (exit 2)
    try:
        role = job_role(load_config(a.config, a.set), None)
        doing, what = ("worker" if role.worker else "launcher"), describe(role)
    except ConfigError as e:  # the environment is fine; this config does not fit it
        doing, what = "error", f"plait train here would stop: {e}"
    if a.json:
        print(json.dumps({**env.to_json(), "plait_train": doing, "plait_train_detail": what}, indent=1))
    else:
        print(format_env(env))
        print(what)
    return 0


def cmd_slurm(a) -> int:
    from plait.launch.slurm import SlurmJob, submit, write_job  # lazily: `plait --help` loads this module

    job = SlurmJob(nodes=a.nodes, time=a.time, cpus_per_task=a.cpus_per_task, gpus_per_node=a.gpus_per_node,
                   partition=a.partition or "", account=a.account or "", grace_s=a.grace, job_name=a.job_name or "")
    cfg = load_config(a.config, a.set)
    if a.gpus_per_node:  # one process per GPU: dp follows the allocation unless --set pins it
        cfg = follow_launch(cfg, a.nodes * a.gpus_per_node, f"--nodes {a.nodes} x --gpus-per-node {a.gpus_per_node}",
                            pinned_dp(a.set), lambda line: print(line, file=sys.stderr))
    script = write_job(cfg, job, Path(a.out))
    print(f"wrote {script} and {Path(a.out) / 'config.toml'}")
    if a.submit:
        print(f"submitted job {submit(script)}")
    else:
        print(f"submit it with: sbatch {script}")
    return 0


def cmd_launch(a) -> int:

    from plait.launch.script import check_script_job, launch_script, split_args  # lazily: no torch for --help

    config, script, args = split_args(a.rest)
    cfg = load_config(config, a.set)
    check_script_job(cfg)  # before the run dir exists: a bad layout leaves nothing behind
    out = a.out or timestamped("launch")
    return launch_script(cfg, out, script, args)


def cmd_k8s(a) -> int:
    from plait.launch import k8s  # lazily: `plait --help` loads this module

    args = list(a.args)
    if args[:1] == ["serve"]:
        if len(args) != 2:
            raise ConfigError("usage: plait k8s serve RUN_DIR --image IMAGE [--pvc NAME] [--min-replicas N] [--kserve]")
        job_only = [f for f, v in (("--nodes", a.nodes), ("--nproc-per-node", a.nproc_per_node), ("--elastic", a.elastic),
                                   ("--kind", a.kind), ("--set", a.set)) if v]
        if job_only:
            raise ConfigError(f"{', '.join(job_only)}: not for plait k8s serve (they shape a training job)")
        docs = k8s.serve_manifests(k8s.K8sServe(
            run_dir=args[1], image=a.image, name=a.name or "plait-serve", pvc=a.pvc or "", min_replicas=a.min_replicas,
            max_replicas=a.max_replicas, kserve=a.kserve, gpus=a.gpus_per_node, namespace=a.namespace or ""))
    else:
        if len(args) > 1:
            raise ConfigError(f"plait k8s takes one CONFIG (or: serve RUN_DIR), not {' '.join(args)}")
        missing = [f for f, v in (("--nodes", a.nodes), ("--nproc-per-node", a.nproc_per_node)) if v is None]
        if missing:
            raise ConfigError(f"plait k8s needs {' and '.join(missing)} (e.g. --nodes 2 --nproc-per-node 8)")
        if a.kserve or a.min_replicas != 1 or a.max_replicas:
            raise ConfigError("--kserve, --min-replicas and --max-replicas are for plait k8s serve")
        job = k8s.K8sJob(name=a.name or "plait-job", image=a.image, nodes=a.nodes, nproc_per_node=a.nproc_per_node,
                         kind=a.kind or "pytorchjob", elastic=a.elastic, gpus_per_node=a.gpus_per_node, pvc=a.pvc or "",
                         namespace=a.namespace or "")
        cfg = follow_launch(load_config(args[0] if args else None, a.set), a.nodes * a.nproc_per_node,
                            f"--nodes {a.nodes} x --nproc-per-node {a.nproc_per_node}", pinned_dp(a.set),
                            lambda line: print(line, file=sys.stderr))
        docs = k8s.job_manifests(cfg, job)
    sys.stdout.write(k8s.to_yaml(docs))
    return 0


def add_parsers(sub, bench) -> None:
    e = sub.add_parser("env", help="what the workload manager's environment says: rank, world size, master (torchrun, "
                                   "Slurm, Kubeflow, MPI, Ray)")
    e.add_argument("config", nargs="?", help="TOML config (decides whether plait train here is a worker or a launcher)")
    e.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    e.add_argument("--json", action="store_true", help="print JSON")
    e.set_defaults(fn=cmd_env)

    s = sub.add_parser("slurm", help="write RUN_DIR/job.sbatch for a Slurm cluster (requeues itself on preemption)")
    s.add_argument("config", nargs="?", help="TOML config file (default: the built-in default job)")
    s.add_argument("--nodes", type=_at_least(1), required=True, help="nodes; one plait launcher on each")
    s.add_argument("--gpus-per-node", type=_at_least(0), default=0, help="GPUs (and worker processes) per node; 0: CPU, "
                                                                          "the layout's processes spread over the nodes")
    s.add_argument("--cpus-per-task", type=_at_least(1), required=True, help="CPUs for each node's task")
    s.add_argument("--time", type=_checked(_time), required=True, help="time limit, HH:MM:SS (or any form sbatch takes)")
    s.add_argument("--partition", help="Slurm partition")
    s.add_argument("--account", help="Slurm account")
    s.add_argument("--job-name", help="job name (default: plait-<run dir name>)")
    s.add_argument("--grace", type=_at_least(1), default=120,
                   help="seconds before the time limit at which the job checkpoints and requeues itself (default 120)")
    s.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    s.add_argument("--out", required=True, help="the run dir, on storage every node sees")
    s.add_argument("--submit", action="store_true", help="sbatch it and print the job id")
    s.set_defaults(fn=cmd_slurm)

    k = sub.add_parser("k8s", help="print Kubernetes manifests: a training job (PyTorchJob, TrainJob, JobSet) or serving",
                       description="plait k8s [CONFIG] --nodes N --nproc-per-node P --image IMAGE ...   a training job\n"
                                   "plait k8s serve RUN_DIR --image IMAGE [--pvc NAME] ...          serving",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    k.add_argument("args", nargs="*", metavar="CONFIG | serve RUN_DIR",
                   help="a training config, or `serve RUN_DIR` for a model server")
    k.add_argument("--image", type=_checked(_image), required=True, help="container image with plait installed")
    k.add_argument("--nodes", type=_at_least(1), help="pods (nodes) of the training job")
    k.add_argument("--nproc-per-node", type=_at_least(1), help="worker processes per pod")
    k.add_argument("--kind", choices=("pytorchjob", "trainjob", "jobset"), help="the training job's kind (default pytorchjob)")
    k.add_argument("--elastic", type=_checked(_elastic), metavar="MIN:MAX", help="PyTorchJob elasticPolicy: go on with MIN "
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
    k.set_defaults(fn=cmd_k8s)

    la = sub.add_parser("launch", help="run your own script in the layout's processes (torchrun's agent); "
                                       "plait.parallelize(model) inside it applies the layout",
                        description="plait launch [--set SECTION.KEY=VALUE ...] [--out DIR] [CONFIG] script.py [args...]")
    la.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    la.add_argument("--out", type=Path, help="run directory for config.toml and logs (default: runs/launch-<time>)")
    la.add_argument("rest", nargs=argparse.REMAINDER, metavar="[CONFIG] script.py [args...]",
                    help="an optional config, your script and its own arguments")
    la.set_defaults(fn=cmd_launch)
