"""plait k8s: manifests that validate offline (built-in kinds with kubernetes-validate, the CRD kinds against their
published schemas in data/), bad flags, and the job run here with exactly the environment each operator would
inject into its pods (one process per pod), ending on the torchrun weights."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from launch_helpers import cli, free_port, run_weights

from helpers import ENV, max_diff
from plait.config import load_config
from plait.parallel.layout import Layout

DATA = Path(__file__).parent / "data"
K8S_VERSION = "1.31.0"
CRDS = {("kubeflow.org", "PyTorchJob"): "kubeflow.org_pytorchjobs", ("trainer.kubeflow.org", "TrainJob"):
        "trainer.kubeflow.org_trainjobs", ("jobset.x-k8s.io", "JobSet"): "jobset.x-k8s.io_jobsets",
        ("serving.kserve.io", "InferenceService"): "serving.kserve.io_inferenceservices"}


def manifests(*args) -> list[dict]:
    code, out, err = cli("k8s", *args)
    assert code == 0, err
    docs = [d for d in yaml.safe_load_all(out) if d]
    assert out.startswith("---\n") and len(docs) == out.count("---\n")
    return docs


def strict(schema):
    """A CRD schema as `kubectl apply` with strict field validation reads it: unknown fields are errors."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items() if not k.startswith("x-kubernetes-validations")}
        if schema.get("x-kubernetes-int-or-string"):
            out.pop("type", None)
            out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        if "properties" in schema and "additionalProperties" not in schema and \
                not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def validate(doc: dict) -> None:
    import jsonschema
    import kubernetes_validate

    group, _, version = doc["apiVersion"].rpartition("/")
    crd = CRDS.get((group, doc["kind"]))
    if crd is None:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        return
    with gzip.open(DATA / f"{crd}.schema.json.gz") as f:
        published = json.load(f)
    schema = strict(published["versions"][version])
    schema["properties"]["metadata"] = {"type": "object"}  # the API server's ObjectMeta (checked below as built-in)
    jsonschema.validate(doc, schema)
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]}, K8S_VERSION,
                                 strict=True)
    for template in pod_templates(doc):  # and each pod template as the built-in PodTemplate it becomes
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                      "template": template}, K8S_VERSION, strict=True)


def pod_templates(doc: dict) -> list[dict]:
    spec = doc["spec"]
    if doc["kind"] == "PyTorchJob":
        return [r["template"] for r in spec["pytorchReplicaSpecs"].values()]
    if doc["kind"] == "JobSet":
        return [r["template"]["spec"]["template"] for r in spec["replicatedJobs"]]
    return []


@pytest.fixture(scope="module")
def kv():
    pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (in plait[dev])")


@pytest.mark.parametrize("args", [
    ["--kind", "pytorchjob", "--nodes", "2", "--nproc-per-node", "1", "--pvc", "runs"],
    ["--kind", "pytorchjob", "--nodes", "4", "--nproc-per-node", "2", "--gpus-per-node", "2", "--pvc", "runs",
     "--elastic", "2:4", "--set", "parallel.dp=8", "--set", "train.global_batch_size=48", "--set", "train.micro_batch_size=2",
     "--namespace", "ml"],
    ["--kind", "pytorchjob", "--nodes", "1", "--nproc-per-node", "2"],
    ["--kind", "trainjob", "--nodes", "2", "--nproc-per-node", "1", "--pvc", "runs", "--gpus-per-node", "1"],
    ["--kind", "jobset", "--nodes", "2", "--nproc-per-node", "1", "--pvc", "runs", "--name", "digits"],
])
def test_job_manifests_validate_against_the_published_schemas(kv, sgd_job, args):
    docs = manifests(sgd_job, "--image", "ghcr.io/example/plait:0.1", *args)
    kinds = [d["kind"] for d in docs]
    assert kinds[0] == "ConfigMap" and kinds[-1] in ("PyTorchJob", "TrainJob", "JobSet")
    for doc in docs:
        validate(doc)
    cfg = docs[0]["data"]["config.toml"]
    assert 'name = "sgd"' in cfg and 'nnodes = "1"' in cfg  # the operator sets the nodes at run time
    if "--elastic" in args:
        policy = docs[-1]["spec"]["elasticPolicy"]
        assert (policy["minReplicas"], policy["maxReplicas"], policy["rdzvBackend"]) == (2, 4, "c10d")
        assert list(docs[-1]["spec"]["pytorchReplicaSpecs"]) == ["Worker"]
    if "jobset" in args:
        assert kinds == ["ConfigMap", "Service", "JobSet"] and docs[1]["spec"]["clusterIP"] == "None"


@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob", "jobset"])
def test_the_validation_is_strict_about_unknown_fields(kv, sgd_job, kind):
    import copy

    def container(doc):  # the trainer's container (a TrainJob's lives in spec.trainer)
        templates = pod_templates(doc)
        return templates[0]["spec"]["containers"][0] if templates else doc["spec"]["trainer"]

    job = manifests(sgd_job, "--image", "ghcr.io/example/plait:0.1", "--kind", kind, "--nodes", "2", "--nproc-per-node", "1",
                    "--pvc", "runs")[-1]
    validate(job)
    for part in (lambda d: d["spec"], container):
        bad = copy.deepcopy(job)
        part(bad)["replicaz"] = 2
        with pytest.raises(Exception, match="replicaz"):
            validate(bad)


@pytest.mark.parametrize("args", [["--pvc", "runs"], [], ["--pvc", "runs", "--kserve", "--min-replicas", "0",
                                                             "--max-replicas", "3"]])
def test_serving_manifests_probe_the_health_endpoints(kv, args):
    docs = manifests("serve", "/plait/runs/plait-job", "--image", "ghcr.io/example/plait:0.1", *args)
    for doc in docs:
        validate(doc)
    if "--kserve" in args:
        (isvc,) = docs
        predictor = isvc["spec"]["predictor"]
        assert (predictor["minReplicas"], predictor["maxReplicas"]) == (0, 3)
        container = predictor["containers"][0]
    else:
        assert [d["kind"] for d in docs] == ["Deployment", "Service"]
        container = docs[0]["spec"]["template"]["spec"]["containers"][0]
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["command"][:3] == ["plait", "serve", "/plait/runs/plait-job"]


@pytest.mark.parametrize("args, message", [
    (["--nodes", "0", "--nproc-per-node", "1"], "argument --nodes: 0 must be >= 1"),
    (["--nodes", "2", "--nproc-per-node", "1", "--image", "my image"], "argument --image: --image 'my image' is not"),
    (["--nodes", "2", "--nproc-per-node", "1", "--image", "Registry/Plait"], "--image 'Registry/Plait'"),
    (["--nodes", "2", "--nproc-per-node", "1", "--elastic", "4:2"], "argument --elastic: --elastic '4:2': need 1 <= MIN <= MAX"),
    (["--nodes", "2", "--nproc-per-node", "1", "--elastic", "1:2", "--kind", "trainjob"], "--elastic needs --kind pytorchjob"),
    (["--nodes", "2", "--nproc-per-node", "1"], "--nodes 2 needs --pvc NAME"),
    (["--nodes", "2", "--nproc-per-node", "2", "--pvc", "r", "--set", "parallel.dp=2"],
     "= 2 processes but --nodes 2 x --nproc-per-node 2 = 4"),  # pinned: a job file's dp alone follows the launch
    (["--nodes", "2", "--nproc-per-node", "1", "--pvc", "r", "--name", "My_Job"], "--name 'My_Job' must be a DNS label"),
    (["--nproc-per-node", "1"], "plait k8s needs --nodes"),
    (["serve", "/plait/runs/a", "--pvc", "r", "--min-replicas", "0"], "--min-replicas 0 (scale to zero when idle) needs --kserve"),
    (["serve", "runs/a", "--pvc", "r"], "give the run dir as the pods see it"),
    (["serve", "/plait/runs/a", "--pvc", "r", "--nodes", "2"], "--nodes: not for plait k8s serve"),
])
def test_bad_k8s_flags_exit_2_naming_the_flag(sgd_job, args, message):
    image = [] if "--image" in args else ["--image", "ghcr.io/example/plait:0.1"]
    config = [] if args[0] == "serve" else [sgd_job]
    code, out, err = cli("k8s", *config, *args, *image)
    assert code == 2, out + err
    assert message in err, err


# ---- the job, run here as the operators would run it


def operator_env(docs: list[dict], mounts: dict[str, str], ports: dict[int, int]) -> list[dict[str, str]]:
    """Each pod's environment: the container's own variables with valueFrom resolved, plus what the operator injects
    (training-operator v1.9 envvar.go/master.go/elastic.go; Trainer v2.3 torch plugin; for a JobSet the Job
    controller's completion index). Pod DNS names resolve to 127.0.0.1 and pod ports to free local ports here;
    the shared volume and the ConfigMap are folders (`mounts`)."""
    job = docs[-1]
    kind, name, spec = job["kind"], job["metadata"]["name"], job["spec"]
    pods = []  # (container, index, injected)
    if kind == "PyTorchJob":
        replicas = spec["pytorchReplicaSpecs"]
        total = sum(r["replicas"] for r in replicas.values())
        nproc = spec.get("nprocPerNode", "auto")
        world = total * (int(nproc) if nproc.isdigit() else 1)
        for rtype in ("Master", "Worker"):
            if rtype not in replicas:
                continue
            container = replicas[rtype]["template"]["spec"]["containers"][0]
            for i in range(replicas[rtype]["replicas"]):
                env = {"PYTHONUNBUFFERED": "1"}
                if "Master" in replicas:
                    port = next(p["containerPort"] for p in replicas["Master"]["template"]["spec"]["containers"][0]["ports"]
                                if p["name"] == "pytorchjob-port")
                    rank = i + (1 if rtype == "Worker" else 0)
                    env.update(MASTER_PORT=str(port), PET_MASTER_PORT=str(port), MASTER_ADDR=f"{name}-master-0",
                               PET_MASTER_ADDR=f"{name}-master-0", WORLD_SIZE=str(world), RANK=str(rank),
                               PET_NODE_RANK=str(rank))
                if "nprocPerNode" in spec:
                    env["PET_NPROC_PER_NODE"] = nproc
                policy = spec.get("elasticPolicy")
                if policy:
                    port = container["ports"][0]["containerPort"]
                    env.update(PET_RDZV_ENDPOINT=f"{name}-worker-0:{port}", PET_RDZV_BACKEND=policy.get("rdzvBackend", "c10d"),
                               PET_NNODES=f"{policy['minReplicas']}:{policy['maxReplicas']}")
                    if "maxRestarts" in policy:
                        env["PET_MAX_RESTARTS"] = str(policy["maxRestarts"])
                else:
                    env["PET_NNODES"] = str(total)
                pods.append((container, f"{name}-{rtype.lower()}-{i}", i, env))
    elif kind == "TrainJob":
        trainer = spec["trainer"]
        container = {"command": trainer["command"], "env": trainer.get("env", [])}
        for i in range(trainer["numNodes"]):
            pods.append((container, f"{name}-node-0-{i}", i, {
                "PET_NNODES": str(trainer["numNodes"]), "PET_NPROC_PER_NODE": str(trainer.get("numProcPerNode", "auto")),
                "PET_NODE_RANK": str(i), "PET_MASTER_ADDR": f"{name}-node-0-0.{name}", "PET_MASTER_PORT": "29500"}))
    else:  # JobSet: an Indexed Job; the controller sets JOB_COMPLETION_INDEX and the completion-index annotation
        rjob = spec["replicatedJobs"][0]
        container = rjob["template"]["spec"]["template"]["spec"]["containers"][0]
        for i in range(rjob["template"]["spec"]["completions"]):
            pods.append((container, f"{name}-{rjob['name']}-0-{i}", i, {"JOB_COMPLETION_INDEX": str(i)}))
    out = []
    for container, pod, index, injected in pods:
        env = {}
        for var in container.get("env", []):
            if "value" in var:
                env[var["name"]] = var["value"]
            else:
                path = var["valueFrom"]["fieldRef"]["fieldPath"]
                assert path == "metadata.annotations['batch.kubernetes.io/job-completion-index']", path
                env[var["name"]] = str(index)
        env.update(injected)
        env["HOSTNAME"] = pod
        for key, value in list(env.items()):
            for path, local in mounts.items():
                if value.startswith(path):
                    env[key] = local + value[len(path):]
            if key in ("MASTER_ADDR", "PET_MASTER_ADDR"):
                env[key] = "127.0.0.1"
            if key in ("MASTER_PORT", "PET_MASTER_PORT"):
                env[key] = str(ports[int(value)])
            if key == "PET_RDZV_ENDPOINT":
                env[key] = f"127.0.0.1:{ports[int(value.rsplit(':', 1)[1])]}"
        out.append({"command": container["command"], "env": env, "pod": pod})
    return out


def run_pods(docs: list[dict], tmp_path: Path, timeout: float = 180) -> Path:
    """Start one process per pod with the operator's environment and the manifest's command; the shared run dir."""
    mounts = {"/plait": str(tmp_path / "pvc"), "/etc/plait": str(tmp_path / "configmap")}
    (tmp_path / "configmap").mkdir()
    (tmp_path / "configmap" / "config.toml").write_text(docs[0]["data"]["config.toml"])
    ports = {23456: free_port(), 29500: free_port()}
    base = {k: v for k, v in ENV.items() if not k.startswith(("SLURM_", "OMPI_", "PMI", "PET_", "TORCHELASTIC_", "RAY_"))
            and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    base["PATH"] = f"{Path(sys.executable).parent}:{base.get('PATH', '/usr/bin:/bin')}"  # `plait` on PATH, as in the image
    procs = []
    try:
        for pod in operator_env(docs, mounts, ports):
            procs.append(subprocess.Popen(pod["command"], env={**base, **pod["env"]}, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
    run = Path(mounts["/plait"]) / "runs" / docs[-1]["metadata"]["name"]
    assert "done: 10 steps" in "".join(outs)
    return run


@pytest.mark.parametrize("kind, nodes, nproc", [("pytorchjob", 2, 1), ("trainjob", 1, 2), ("jobset", 2, 1)])
def test_the_job_trains_under_the_operators_environment_like_torchrun(sgd_job, sgd_reference, tmp_path, kind, nodes, nproc):
    docs = manifests(sgd_job, "--image", "ghcr.io/example/plait:0.1", "--kind", kind, "--nodes", str(nodes),
                     "--nproc-per-node", str(nproc), "--pvc", "runs")
    run = run_pods(docs, tmp_path)
    assert max_diff(sgd_reference, run_weights(run)) <= 1e-5
    session = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert (session["manager"], session["world_size"]) == ("torchrun", 2)
    assert not os.path.exists(run / ".config.toml")


@pytest.mark.parametrize("value", ["a\u2028kind: Pod\nmetadata: {}", "one\u0085---\nkind: Pod", "\n  first\nx",
                                   "tab\tand\r\nreturn", "plain\n  lines\n\nkept"])
def test_a_value_yaml_would_read_otherwise_stays_one_string(value):
    """Issue 37 N11: multi-line strings were raw block scalars; U+2028 injected a whole Pod for a YAML 1.1 parser."""
    from plait.launch.k8s import to_yaml

    text = to_yaml([{"kind": "ConfigMap", "data": {"script": value}, "args": [value]}])
    docs = [d for d in yaml.safe_load_all(text) if d]
    assert docs == [{"kind": "ConfigMap", "data": {"script": value}, "args": [value]}]
    assert ("|-" in text) == (value == "plain\n  lines\n\nkept")  # a block only where it is safe


def test_the_readme_job_follows_the_launch_unless_dp_is_pinned(tmp_path):
    """issue 38 item 5: the README's job.toml (plait config show: dp = 2) with --nodes 2 --nproc-per-node 8."""
    job = tmp_path / "job.toml"
    code, out, err = cli("config", "show")
    job.write_text(out)
    code, out, err = cli("k8s", job, "--nodes", "2", "--nproc-per-node", "8", "--image", "ghcr.io/me/plait:0.1",
                         "--pvc", "runs")
    assert code == 0, err
    assert err.strip() == ("parallel.dp 2 -> 16 to fill --nodes 2 x --nproc-per-node 8 (16 processes / tp 1 x pp 1), "
                           "train.micro_batch_size 16 -> 2 (the global batch kept); pin it with --set parallel.dp=N")
    config = next(d for d in yaml.safe_load_all(out) if d and d["kind"] == "ConfigMap")["data"]["config.toml"]
    assert "\ndp = 16\n" in config and "\nmicro_batch_size = 2\n" in config and "\nglobal_batch_size = 32\n" in config
    code, _, err = cli("k8s", job, "--nodes", "2", "--nproc-per-node", "8", "--image", "ghcr.io/me/plait:0.1",
                       "--pvc", "runs", "--set", "parallel.dp=auto")
    assert code == 0 and "parallel.dp 1 -> 16" in err  # "auto" resolved here (no GPU: 1) follows the launch too


@pytest.mark.parametrize("axis", ["cp", "tp", "pp"])
def test_a_cp2_tp2_or_pp2_job_keeps_its_degrees_in_the_manifests(tmp_path, axis):
    """issue 56 item 5: dp = 1 with cp, tp or pp = 2 on one pod of 2 processes stays as it is (the cp job was rewritten
    to dp = 2, four processes, and refused, before); an elastic range is checked at every size with cp counted."""
    job = tmp_path / "job.toml"
    job.write_text(f"[parallel]\ndp = 1\n{axis} = 2\n")
    code, out, err = cli("k8s", job, "--nodes", "1", "--nproc-per-node", "2", "--image", "ghcr.io/me/plait:0.1")
    assert code == 0 and err == "", err
    docs = [d for d in yaml.safe_load_all(out) if d]
    (tmp_path / "config.toml").write_text(next(d for d in docs if d["kind"] == "ConfigMap")["data"]["config.toml"])
    cfg = load_config(tmp_path / "config.toml")
    assert (cfg.parallel.dp, getattr(cfg.parallel, axis)) == (1, 2)
    assert Layout.from_config(cfg).world_size == 2
    assert next(d for d in docs if d["kind"] == "PyTorchJob")["spec"]["nprocPerNode"] == "2"
    code, _, err = cli("k8s", job, "--nodes", "2", "--nproc-per-node", "1", "--elastic", "1:2", "--pvc", "runs",
                       "--image", "ghcr.io/me/plait:0.1")
    per = {"cp": "cp(2) * tp(1) * pp(1)", "tp": "tp(2) * pp(1)", "pp": "tp(1) * pp(2)"}[axis]
    assert code == 2 and err.strip() == (
        f"error: --elastic 1:2 at 1 nodes: no whole parallel.dp fits 1 nodes x --nproc-per-node 1 = 1 processes: dp * "
        f"{per} = 1 leaves dp = 1 / 2; give the job a multiple of 2 processes, or change parallel.{axis}; or raise MIN")
