"""`plait k8s`: Kubernetes manifests for a training job (Kubeflow PyTorchJob or TrainJob, or a JobSet) and for serving.

    docs = job_manifests(cfg, K8sJob(name="plait-job", image="registry/plait:1", nodes=2, nproc_per_node=8))
    print(to_yaml(docs))

Every pod runs the same command: copy the config (a ConfigMap) into the run dir on the shared volume once, then
`plait train --resume RUN_DIR`, which starts at step 0 in a new run dir and continues from checkpoints/latest
after a pod restart. plait.launch.env reads what the operator injects into the pod (PET_NNODES,
PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR/PORT, or PET_RDZV_ENDPOINT for an elastic PyTorchJob) and
plait's launcher starts the node's workers with a c10d rendezvous on the first pod. A JobSet has no operator of
its own to do that: plait writes the same PET_* variables into it (the node's index from the Job's completion
index) and a headless Service for the pods' DNS names.

Serving: a Deployment and a Service (or a KServe InferenceService) running `plait serve RUN_DIR`, with the
liveness and readiness probes on /v2/health/live and /v2/health/ready.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass

from plait.config import Config, dump_config
from plait.errors import ConfigError
from plait.parallel.layout import Layout, resized

KINDS = ("pytorchjob", "trainjob", "jobset")
RUN_MOUNT = "/plait"  # where the shared volume (--pvc) is mounted; run dirs live in /plait/runs/<name>
CONFIG_MOUNT = "/etc/plait"  # the ConfigMap with config.toml
PYTORCHJOB_PORT = 23456  # training-operator's default master port (port name pytorchjob-port)
TRAINER_PORT = 29500  # Trainer v2's and plait's JobSet rendezvous port
SERVE_PORT = 8080  # KServe's default container port; the Deployment uses the same

# Once in the run dir, atomically (pods start together on one shared volume), then continue or start the run.
POD_SCRIPT = "\n".join([
    "set -e",
    'mkdir -p "$PLAIT_RUN_DIR"',
    'if [ ! -f "$PLAIT_RUN_DIR/config.toml" ]; then',
    '  tmp="$PLAIT_RUN_DIR/.config.toml.$(hostname).$$"',
    '  cp "$PLAIT_CONFIG" "$tmp" && mv "$tmp" "$PLAIT_RUN_DIR/config.toml"',
    "fi",
    'exec plait train --resume "$PLAIT_RUN_DIR"',
])


@dataclass
class K8sJob:
    name: str
    image: str
    nodes: int
    nproc_per_node: int
    kind: str = "pytorchjob"
    elastic: tuple[int, int] | None = None  # (min, max) nodes
    gpus_per_node: int = 0
    pvc: str = ""
    namespace: str = ""
    max_restarts: int = 3


# --------------------------------------------------------------------------- input checks (exit 2 naming the flag)

_IMAGE = re.compile(
    r"(?:(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*|\[[0-9a-fA-F:]+\])"
    r"(?::[0-9]+)?/)?"  # registry host[:port]/
    r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*)*"  # path
    r"(?::[\w][\w.-]{0,127})?"  # :tag
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?")  # @digest


def check_image(image: str) -> str:
    if not image or not _IMAGE.fullmatch(image) or len(image) > 255:
        raise ConfigError(f"--image {image!r} is not a container image reference: [registry[:port]/]name[:tag][@digest], "
                          "lowercase path, no spaces (e.g. ghcr.io/me/plait:0.1)")
    return image


def check_name(name: str, flag: str = "--name") -> str:
    if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) or len(name) > 40:
        raise ConfigError(f"{flag} {name!r} must be a DNS label of at most 40 characters (lowercase letters, digits and "
                          "'-', starting with a letter): pods are named after it")
    return name


def parse_elastic(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    if not sep or not lo.strip().isdigit() or not hi.strip().isdigit():
        raise ConfigError(f"--elastic {text!r} must be MIN:MAX nodes, e.g. --elastic 2:4")
    lo_n, hi_n = int(lo), int(hi)
    if not 1 <= lo_n <= hi_n:
        raise ConfigError(f"--elastic {text!r}: need 1 <= MIN <= MAX (MIN nodes keep the job going, MAX is the full size)")
    return lo_n, hi_n


def job_config(cfg: Config, job: K8sJob) -> Config:
    """The config the pods get, checked against the job's shape: the operator decides nodes and ranks at run time."""
    check_name(job.name)
    check_image(job.image)
    if job.kind not in KINDS:
        raise ConfigError(f"--kind {job.kind!r} is not one of {', '.join(KINDS)}")
    for flag, value, low in (("--nodes", job.nodes, 1), ("--nproc-per-node", job.nproc_per_node, 1),
                             ("--gpus-per-node", job.gpus_per_node, 0)):
        if value < low:
            raise ConfigError(f"{flag} {value} must be >= {low}")
    if job.elastic and job.kind != "pytorchjob":
        raise ConfigError(f"--elastic needs --kind pytorchjob (its elasticPolicy); {job.kind} runs a fixed number of nodes")
    if job.elastic and job.elastic[1] != job.nodes:
        raise ConfigError(f"--elastic {job.elastic[0]}:{job.elastic[1]}: MAX must be --nodes ({job.nodes}), the size the "
                          "config's layout describes")
    if job.nodes > 1 and not job.pvc:
        raise ConfigError(f"--nodes {job.nodes} needs --pvc NAME: the run dir (checkpoints of every rank) must be on a volume "
                          "all pods share (a ReadWriteMany PersistentVolumeClaim)")
    new = copy.deepcopy(cfg)
    new.launch.nnodes, new.launch.node_rank, new.launch.rdzv_endpoint = "1", 0, ""  # the operator's, at run time
    new.launch.nproc_per_node, new.launch.local_addr = 0, ""
    if new.launch.launcher != "torchrun":
        raise ConfigError(f"launch.launcher = {new.launch.launcher!r}: the pods run plait's torchrun launcher; "
                          "set launch.launcher='torchrun'")
    Layout.resolve(new, job.nodes * job.nproc_per_node, f"--nodes {job.nodes} x --nproc-per-node {job.nproc_per_node}"
                   ).check()
    for n in range(job.elastic[0] if job.elastic else job.nodes, job.nodes):  # each size the job may shrink to
        try:  # as the workers will resize it (plait.launch.job.fit_to_world): dp follows, the batch must split
            Layout.from_config(resized(new, n * job.nproc_per_node, f"{n} nodes x --nproc-per-node {job.nproc_per_node}"))
        except ConfigError as e:
            raise ConfigError(f"--elastic {job.elastic[0]}:{job.elastic[1]} at {n} nodes: {e}; or raise MIN") from None
    if job.elastic:
        new.launch.max_restarts = max(new.launch.max_restarts, job.max_restarts)
    return new


# --------------------------------------------------------------------------- the pieces


def _labels(job_name: str) -> dict:
    return {"app.kubernetes.io/name": "plait", "app.kubernetes.io/instance": job_name}


def _meta(name: str, namespace: str, labels: dict | None = None) -> dict:
    meta = {"name": name}
    if namespace:
        meta["namespace"] = namespace
    meta["labels"] = labels or {"app.kubernetes.io/name": "plait"}
    return meta


def run_dir(name: str) -> str:
    return f"{RUN_MOUNT}/runs/{name}"


def _volumes(job: K8sJob) -> list[dict]:
    run = {"name": "run", "persistentVolumeClaim": {"claimName": job.pvc}} if job.pvc else {"name": "run", "emptyDir": {}}
    return [run, {"name": "config", "configMap": {"name": f"{job.name}-config"}}]


def _mounts() -> list[dict]:
    return [{"name": "run", "mountPath": RUN_MOUNT}, {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True}]


def _resources(gpus: int) -> dict:
    return {"limits": {"nvidia.com/gpu": gpus}} if gpus else {}


def _plait_env(job: K8sJob) -> list[dict]:
    return [{"name": "PLAIT_RUN_DIR", "value": run_dir(job.name)},
            {"name": "PLAIT_CONFIG", "value": f"{CONFIG_MOUNT}/config.toml"}]


def _container(job: K8sJob, name: str, port: int, port_name: str = "rdzv", env: list[dict] | None = None) -> dict:
    c = {"name": name, "image": job.image, "command": ["sh", "-c", POD_SCRIPT], "env": _plait_env(job) + (env or []),
         "ports": [{"name": port_name, "containerPort": port}], "volumeMounts": _mounts()}
    if job.gpus_per_node:
        c["resources"] = _resources(job.gpus_per_node)
    return c


def config_map(cfg: Config, job: K8sJob) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(f"{job.name}-config", job.namespace, _labels(job.name)),
            "data": {"config.toml": dump_config(cfg)}}


def pytorchjob(job: K8sJob) -> dict:
    """Kubeflow training-operator v1 (kubeflow.org/v1): a Master pod and Worker pods (or Worker pods under an elasticPolicy)."""

    def replica(n: int) -> dict:
        return {"replicas": n, "restartPolicy": "OnFailure",
                "template": {"metadata": {"labels": _labels(job.name)},
                             "spec": {"containers": [_container(job, "pytorch", PYTORCHJOB_PORT, "pytorchjob-port")],
                                      "volumes": _volumes(job)}}}

    spec: dict = {"nprocPerNode": str(job.nproc_per_node)}
    if job.elastic:
        spec["elasticPolicy"] = {"minReplicas": job.elastic[0], "maxReplicas": job.elastic[1], "rdzvBackend": "c10d",
                                 "maxRestarts": job.max_restarts}
        spec["pytorchReplicaSpecs"] = {"Worker": replica(job.nodes)}
    else:
        spec["pytorchReplicaSpecs"] = {"Master": replica(1)}
        if job.nodes > 1:
            spec["pytorchReplicaSpecs"]["Worker"] = replica(job.nodes - 1)
    spec["runPolicy"] = {"cleanPodPolicy": "None", "backoffLimit": job.max_restarts}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": _meta(job.name, job.namespace, _labels(job.name)),
            "spec": spec}


def trainjob(job: K8sJob) -> dict:
    """Kubeflow Trainer v2 (trainer.kubeflow.org/v1alpha1) on the torch-distributed ClusterTrainingRuntime; the volumes
    reach the runtime's `node` pods through a runtime patch."""
    trainer = {"image": job.image, "command": ["sh", "-c", POD_SCRIPT], "env": _plait_env(job), "numNodes": job.nodes,
               "numProcPerNode": job.nproc_per_node}
    if job.gpus_per_node:
        trainer["resourcesPerNode"] = _resources(job.gpus_per_node)
    pod = {"volumes": _volumes(job), "containers": [{"name": "node", "volumeMounts": _mounts()}]}
    patch = {"manager": "plait", "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
        {"name": "node", "template": {"spec": {"template": {"spec": pod}}}}]}}}}
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
            "metadata": _meta(job.name, job.namespace, _labels(job.name)),
            "spec": {"runtimeRef": {"name": "torch-distributed"}, "trainer": trainer, "runtimePatches": [patch]}}


def jobset(job: K8sJob) -> list[dict]:
    """A JobSet (jobset.x-k8s.io/v1alpha2): one Indexed Job of N pods and a headless Service; the PET_* variables a
    Kubeflow operator would inject are written here, the node's index from the Job's completion index."""
    master = f"{job.name}-node-0-0.{job.name}"  # <jobset>-<replicated job>-<job index>-<pod index>.<subdomain>
    env = [{"name": "PET_NNODES", "value": str(job.nodes)},
           {"name": "PET_NPROC_PER_NODE", "value": str(job.nproc_per_node)},
           {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {
               "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
           {"name": "PET_MASTER_ADDR", "value": master},
           {"name": "PET_MASTER_PORT", "value": str(TRAINER_PORT)}]
    pod_spec = {"restartPolicy": "Never", "containers": [_container(job, "node", TRAINER_PORT, env=env)],
                "volumes": _volumes(job)}
    js = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": _meta(job.name, job.namespace, _labels(job.name)),
          "spec": {"network": {"enableDNSHostnames": True, "subdomain": job.name, "publishNotReadyAddresses": True},
                   "failurePolicy": {"maxRestarts": job.max_restarts},
                   "replicatedJobs": [{"name": "node", "replicas": 1, "template": {"spec": {
                       "parallelism": job.nodes, "completions": job.nodes, "completionMode": "Indexed", "backoffLimit": 0,
                       "template": {"metadata": {"labels": _labels(job.name)}, "spec": pod_spec}}}}]}}
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(job.name, job.namespace, _labels(job.name)),
           "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                    "selector": {"jobset.sigs.k8s.io/jobset-name": job.name},
                    "ports": [{"name": "rdzv", "port": TRAINER_PORT, "targetPort": TRAINER_PORT}]}}
    return [svc, js]


def job_manifests(cfg: Config, job: K8sJob) -> list[dict]:
    cfg = job_config(cfg, job)
    docs = [config_map(cfg, job)]
    if job.kind == "pytorchjob":
        docs.append(pytorchjob(job))
    elif job.kind == "trainjob":
        docs.append(trainjob(job))
    else:
        docs += jobset(job)
    return docs


# --------------------------------------------------------------------------- serving


@dataclass
class K8sServe:
    run_dir: str  # as the pods see it, e.g. /plait/runs/<name>
    image: str
    name: str = "plait-serve"
    pvc: str = ""
    min_replicas: int = 1
    max_replicas: int = 0  # 0: = min_replicas (at least 1)
    kserve: bool = False
    gpus: int = 0
    namespace: str = ""


def _probe(path: str, initial: int, period: int) -> dict:
    return {"httpGet": {"path": path, "port": SERVE_PORT}, "initialDelaySeconds": initial, "periodSeconds": period,
            "timeoutSeconds": 5, "failureThreshold": 3}


def serve_manifests(s: K8sServe) -> list[dict]:
    check_name(s.name)
    check_image(s.image)
    if s.min_replicas < 0 or s.max_replicas < 0:
        raise ConfigError("--min-replicas and --max-replicas must be >= 0")
    if s.min_replicas == 0 and not s.kserve:
        raise ConfigError("--min-replicas 0 (scale to zero when idle) needs --kserve: a plain Deployment keeps at least one "
                          "replica; KServe's InferenceService (Knative) scales to zero")
    if not s.run_dir.startswith("/"):
        raise ConfigError(f"RUN_DIR {s.run_dir!r}: give the run dir as the pods see it, e.g. {RUN_MOUNT}/runs/<name> "
                          f"(the --pvc volume is mounted at {RUN_MOUNT})")
    if s.max_replicas and s.max_replicas < max(1, s.min_replicas):
        raise ConfigError(f"--max-replicas {s.max_replicas} must be >= --min-replicas {s.min_replicas} (and >= 1)")
    max_replicas = max(s.max_replicas, s.min_replicas, 1)
    container = {"name": "kserve-container" if s.kserve else "plait", "image": s.image,
                 "command": ["plait", "serve", s.run_dir, "--host", "0.0.0.0", "--port", str(SERVE_PORT)],
                 "ports": [{"containerPort": SERVE_PORT, "protocol": "TCP"} if s.kserve else
                           {"name": "http", "containerPort": SERVE_PORT, "protocol": "TCP"}],
                 "livenessProbe": _probe("/v2/health/live", 10, 10), "readinessProbe": _probe("/v2/health/ready", 5, 5)}
    volumes = []  # without --pvc the run dir is in the image
    if s.pvc:
        container["volumeMounts"] = [{"name": "run", "mountPath": RUN_MOUNT, "readOnly": True}]
        volumes = [{"name": "run", "persistentVolumeClaim": {"claimName": s.pvc, "readOnly": True}}]
    if s.gpus:
        container["resources"] = _resources(s.gpus)
    labels = {"app.kubernetes.io/name": "plait-serve", "app.kubernetes.io/instance": s.name}
    if s.kserve:
        return [{"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService",
                 "metadata": _meta(s.name, s.namespace, labels),
                 "spec": {"predictor": {"minReplicas": s.min_replicas, "maxReplicas": max_replicas,
                                        "containers": [container], **({"volumes": volumes} if volumes else {})}}}]
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(s.name, s.namespace, labels),
                  "spec": {"replicas": max(1, s.min_replicas), "selector": {"matchLabels": labels},
                           "template": {"metadata": {"labels": labels},
                                        "spec": {"containers": [container], **({"volumes": volumes} if volumes else {})}}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(s.name, s.namespace, labels),
               "spec": {"selector": labels, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}}
    return [deployment, service]


# --------------------------------------------------------------------------- YAML out (no dependency: plain data only)

_PLAIN = re.compile(r"[A-Za-z_/][A-Za-z0-9_./-]*")  # anything else (digits first, spaces, quotes, ':') is quoted
_RESERVED = {"true", "false", "yes", "no", "on", "off", "null", "y", "n", "~"}


def _scalar(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return json.dumps(v)
    s = str(v)
    if _PLAIN.fullmatch(s) and s.lower() not in _RESERVED:
        return s
    return json.dumps(s)


def _block(v) -> bool:
    """A multi-line string written as a `|-` block: printable ASCII lines only, the first that is not empty not
    starting with a space (a block cannot hold another line break, U+2028 or U+0085 included, and takes its
    indentation from that line); anything else is a double-quoted, escaped scalar."""
    if not (isinstance(v, str) and "\n" in v and all(c == "\n" or " " <= c <= "~" for c in v)):
        return False
    return not next((line for line in v.split("\n") if line), "").startswith(" ")


def _emit(obj, indent: int, lines: list[str]) -> None:
    pad = "  " * indent
    if isinstance(obj, dict):
        for k, v in obj.items():
            key = _scalar(k)
            if isinstance(v, (dict, list)) and v:
                lines.append(f"{pad}{key}:")
                _emit(v, indent + 1 if isinstance(v, dict) else indent, lines)
            elif _block(v):
                lines.append(f"{pad}{key}: |-")
                lines += [f"{pad}  {line}" if line else "" for line in v.split("\n")]
            elif isinstance(v, (dict, list)):
                lines.append(f"{pad}{key}: {'{}' if isinstance(v, dict) else '[]'}")
            else:
                lines.append(f"{pad}{key}: {_scalar(v)}")
    elif isinstance(obj, list):
        for item in obj:
            if isinstance(item, (dict, list)) and item:
                sub: list[str] = []
                _emit(item, indent + 1, sub)
                first = sub[0][len("  " * (indent + 1)):]
                lines.append(f"{pad}- {first}")
                lines += sub[1:]
            elif _block(item):
                lines.append(f"{pad}- |-")
                lines += [f"{pad}  {line}" if line else "" for line in item.split("\n")]
            else:
                lines.append(f"{pad}- {_scalar(item)}")


def to_yaml(docs: list[dict]) -> str:
    """Documents as one YAML stream (block style; strings quoted where YAML would read them otherwise)."""
    out = []
    for doc in docs:
        lines: list[str] = []
        _emit(doc, 0, lines)
        out.append("\n".join(lines))
    return "---\n" + "\n---\n".join(out) + "\n"
