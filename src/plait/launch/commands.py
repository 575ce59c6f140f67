"""What `plait env`, `plait slurm` and `plait k8s` do (their parsers: plait.launch.cli); none imports torch.

`plait train` runs plait.launch.start.cmd_train (the launcher, torch-free until the job check) and `plait launch`
plait.launch.script.cmd_launch (torch's elastic agent).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from plait.config import load_config
from plait.errors import ConfigError
from plait.launch import k8s
from plait.launch.env import format_env, resolve
from plait.launch.follow import follow_launch, pinned_dp
from plait.launch.role import describe, job_role
from plait.launch.slurm import SlurmJob, submit, write_job


def cmd_env(a) -> int:
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


def cmd_k8s(a) -> int:
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
