"""Where this process stands in its job, read from the variables its workload manager set: one place for all of them.

    env = resolve()              # os.environ by default; any mapping in tests
    env.manager, env.rank, env.world_size, env.local_rank, env.node_rank, env.master_addr, env.master_port

Managers are asked in this order; the first whose variables are present describes the job:

| manager    | applies when                                    | reads                                                   |
| ---------- | ----------------------------------------------- | ------------------------------------------------------- |
| torchrun   | TORCHELASTIC_RUN_ID (a worker of torchrun's     | RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK  |
|            | agent, plait's launcher included)               | GROUP_WORLD_SIZE MASTER_ADDR MASTER_PORT                |
|            |                                                 | TORCHELASTIC_RESTART_COUNT                              |
| slurm      | SLURM_JOB_ID and SLURM_STEP_ID (a task of srun) | SLURM_PROCID SLURM_NTASKS SLURM_LOCALID SLURM_NODEID    |
|            |                                                 | SLURM_JOB_NODELIST (expanded: n[1-3,7]) SLURM_STEP_*    |
|            |                                                 | SLURM_RESTART_COUNT; MASTER_ADDR/MASTER_PORT override   |
|            |                                                 | the first node and 15000 + the job id's last 4 digits   |
| kubeflow   | PET_* (PyTorchJob >= 1.7, Trainer v2 TrainJob,  | PET_NNODES PET_NPROC_PER_NODE PET_NODE_RANK             |
|            | plait's JobSet) or RANK/WORLD_SIZE (a           | PET_MASTER_ADDR PET_MASTER_PORT PET_RDZV_ENDPOINT       |
|            | PyTorchJob without nprocPerNode)                | PET_RDZV_BACKEND PET_MAX_RESTARTS; MASTER_ADDR          |
|            |                                                 | MASTER_PORT WORLD_SIZE RANK LOCAL_RANK                  |
| mpi        | OMPI_COMM_WORLD_* (Open MPI), PMI_RANK/PMI_SIZE | rank, size, local rank and size; MASTER_ADDR (needed    |
|            | (MPICH, Intel MPI), PMIX_RANK                   | when the ranks span hosts), MASTER_PORT (else derived   |
|            |                                                 | from the MPI job id)                                    |
| ray        | PLAIT_RAY_RANK (set by plait's Ray launcher in  | PLAIT_RAY_* and the MASTER_ADDR/MASTER_PORT Ray Train   |
|            | each Ray Train worker)                          | set                                                     |
| none       | nothing above                                   | one process                                             |

Two exceptions keep the order honest: Slurm's variables do not describe a rank that mpirun started inside an
allocation (the MPI world differs from the Slurm step's), and Kubeflow's torch variables are Ray Train's own
inside a Ray worker.

A job is described at one of two levels. "process": the manager started every rank (srun -n 4, mpirun -n 4, a
torchrun worker, a Ray worker), so this process knows its rank. "node": the manager started one launcher per
node and says how many processes each starts (PET_NPROC_PER_NODE); torchrun's agent (plait's launcher) numbers
the ranks. An environment that names only some of a manager's variables, or whose variables contradict each
other, raises ClusterEnvError naming them. Nothing here imports torch.
"""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from plait.errors import ConfigError


class ClusterEnvError(ConfigError):
    """The manager's variables are partial or contradict each other (the message names them)."""


@dataclass(frozen=True)
class ClusterEnv:
    manager: str  # torchrun, slurm, kubeflow, mpi, ray or none
    level: str  # "process" (this process is one rank) or "node" (a launcher for the node's ranks)
    world_size: int | None  # processes in the job (None: decided on the node, e.g. PET_NPROC_PER_NODE=auto)
    rank: int | None  # this process's global rank (None at node level)
    local_rank: int | None
    local_world_size: int | None  # processes on this node
    node_rank: int | None  # this node's index (None: the rendezvous assigns it, an elastic job)
    nnodes: str  # "N", or "MIN:MAX" for an elastic job
    master_addr: str  # rank 0's host (or the rendezvous host)
    master_port: int
    restart_count: int = 0  # how often the manager restarted or requeued this job
    job_id: str = ""  # the same on every rank of one job (names the default run dir)
    rdzv_backend: str = ""  # node level: the rendezvous the manager asks for (empty: plait's default, c10d)
    max_restarts: int | None = None  # node level: restarts the manager allows (PET_MAX_RESTARTS)
    detail: str = ""  # e.g. "PyTorchJob" or "Open MPI"
    variables: dict = field(default_factory=dict)  # the variables read, as found

    @property
    def endpoint(self) -> str:
        return f"{self.master_addr}:{self.master_port}"

    def to_json(self) -> dict:
        return asdict(self)

    def world_source(self) -> str:
        """How the manager states the world size, for messages ("Slurm's SLURM_NTASKS")."""
        names = {"torchrun": "torchrun's WORLD_SIZE", "slurm": "Slurm's SLURM_NTASKS", "ray": "Ray's PLAIT_RAY_WORLD_SIZE",
                 "kubeflow": "Kubeflow's WORLD_SIZE" if self.level == "process" else
                 "Kubeflow's PET_NNODES * PET_NPROC_PER_NODE", "none": "a single process"}
        if self.manager == "mpi":
            return "mpirun's OMPI_COMM_WORLD_SIZE" if "OMPI_COMM_WORLD_SIZE" in self.variables else "MPI's PMI_SIZE"
        return names.get(self.manager, self.manager)


# --------------------------------------------------------------------------- helpers


def _int(env: Mapping[str, str], name: str, manager: str, minimum: int = 0) -> int:
    text = env[name].strip()
    try:
        value = int(text)
    except ValueError:
        raise ClusterEnvError(f"{manager}: {name}={env[name]!r} is not an integer") from None
    if value < minimum:
        raise ClusterEnvError(f"{manager}: {name}={value} must be >= {minimum}")
    return value


def _need(env: Mapping[str, str], names: tuple[str, ...], manager: str, why: str) -> None:
    missing = [n for n in names if not env.get(n, "").strip()]
    if missing:
        present = [n for n in names if n not in missing]
        raise ClusterEnvError(
            f"{manager} environment is incomplete: {why} but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set" + (f" (found {', '.join(present)})" if present else "")
            + "; set them, or unset the others to run without a workload manager")


def _read(env: Mapping[str, str], prefixes: tuple[str, ...], names: tuple[str, ...] = ()) -> dict:
    return {k: v for k, v in sorted(env.items()) if k.startswith(prefixes) or k in names}


def _below(value: int, name: str, bound: int, bound_name: str, manager: str) -> None:
    if not 0 <= value < bound:
        raise ClusterEnvError(f"{manager}: {name}={value} contradicts {bound_name}={bound} (need 0 <= {name} < {bound_name})")


def _port(env: Mapping[str, str], manager: str) -> int | None:
    if not env.get("MASTER_PORT", "").strip():
        return None
    port = _int(env, "MASTER_PORT", manager, 1)
    if port > 65535:
        raise ClusterEnvError(f"{manager}: MASTER_PORT={port} is not a TCP port (1..65535)")
    return port


def _split_endpoint(text: str, name: str, manager: str) -> tuple[str, int]:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ClusterEnvError(f"{manager}: {name}={text!r} must be host:port")
    return host.strip("[]"), int(port)


# --------------------------------------------------------------------------- Slurm's compressed host lists


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets: "a[1-2],b,c[3,5]" -> ["a[1-2]", "b", "c[3,5]"]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in {text!r}")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _range(item: str) -> list[str]:
    lo, sep, hi = item.partition("-")
    if not lo.isdigit() or (sep and not hi.isdigit()):
        raise ValueError(f"{item!r} is not a number or a range of numbers")
    if not sep:
        return [lo]
    if int(hi) < int(lo):
        raise ValueError(f"range {item!r} runs backwards")
    width = len(lo) if lo.startswith("0") and len(lo) > 1 else 0  # n[01-10]: zero-padded to the first bound's width
    return [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]


def _expand_one(pattern: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", pattern)
    if m is None:
        if "[" in pattern or "]" in pattern:
            raise ValueError(f"unbalanced brackets in {pattern!r}")
        return [pattern]
    head, tail = pattern[:m.start()], pattern[m.end():]
    values = [v for item in m.group(1).split(",") if item.strip() for v in _range(item.strip())]
    if not values:
        raise ValueError(f"empty brackets in {pattern!r}")
    return [head + v + rest for v in values for rest in _expand_one(tail)]


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list in order: "n[1-3,7],gpu[01-02]" -> n1 n2 n3 n7 gpu01 gpu02
    (what `scontrol show hostnames` prints); several bracket groups in one name expand as a product."""
    try:
        hosts = [h for part in _split_top(text.strip()) for h in _expand_one(part)]
    except ValueError as e:
        raise ClusterEnvError(f"slurm: cannot read the node list {text!r}: {e}") from None
    if not hosts:
        raise ClusterEnvError(f"slurm: the node list {text!r} names no node")
    return hosts


def tasks_per_node(text: str) -> list[int]:
    """Slurm's SLURM_TASKS_PER_NODE form: "2(x3),1" -> [2, 2, 2, 1]."""
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ClusterEnvError(f"slurm: cannot read the tasks per node {text!r} (expected e.g. 2(x3),1)")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


# --------------------------------------------------------------------------- the managers


class Manager:
    """One workload manager: whether its variables are there, and what they say."""

    name = ""

    def applies(self, env: Mapping[str, str]) -> bool:
        raise NotImplementedError

    def resolve(self, env: Mapping[str, str]) -> ClusterEnv:
        raise NotImplementedError


class Torchrun(Manager):
    """A worker of torchrun's elastic agent (plait's launcher or a plain torchrun)."""

    name = "torchrun"

    def applies(self, env):
        return "TORCHELASTIC_RUN_ID" in env

    def resolve(self, env):
        m = self.name
        _need(env, ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"), m,
              "TORCHELASTIC_RUN_ID says this is a torchrun worker")
        world, rank = _int(env, "WORLD_SIZE", m, 1), _int(env, "RANK", m)
        _below(rank, "RANK", world, "WORLD_SIZE", m)
        local = _int(env, "LOCAL_RANK", m)
        local_world = _int(env, "LOCAL_WORLD_SIZE", m, 1) if env.get("LOCAL_WORLD_SIZE") else None
        if local_world is not None:
            _below(local, "LOCAL_RANK", local_world, "LOCAL_WORLD_SIZE", m)
        groups = _int(env, "GROUP_WORLD_SIZE", m, 1) if env.get("GROUP_WORLD_SIZE") else None
        group = _int(env, "GROUP_RANK", m) if env.get("GROUP_RANK") else None
        if groups is not None and group is not None:
            _below(group, "GROUP_RANK", groups, "GROUP_WORLD_SIZE", m)
        nnodes = groups or (max(1, world // local_world) if local_world else 1)
        return ClusterEnv(m, "process", world, rank, local, local_world, group, str(nnodes), env["MASTER_ADDR"],
                          _port(env, m), _int(env, "TORCHELASTIC_RESTART_COUNT", m) if env.get("TORCHELASTIC_RESTART_COUNT")
                          else 0, env["TORCHELASTIC_RUN_ID"], variables=_read(env, ("TORCHELASTIC_", "GROUP_"), (
                              "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")))


def _mpi_size_rank(env: Mapping[str, str]) -> tuple[int | None, int | None]:
    for size, rank in (("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"), ("PMI_SIZE", "PMI_RANK")):
        if env.get(size, "").strip().isdigit():
            r = env.get(rank, "").strip()
            return int(env[size]), int(r) if r.isdigit() else None
    return None, None


class Slurm(Manager):
    """A task of an srun job step (srun -n N plait train ..., or one launcher per node in plait's job.sbatch)."""

    name = "slurm"

    def applies(self, env):
        if "SLURM_JOB_ID" not in env or not ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
            return False  # the batch script itself, or an salloc shell: not a task of a step
        size, rank = _mpi_size_rank(env)
        if size is None:
            return True
        # mpirun inside an allocation: its daemons were Slurm's tasks, the ranks are MPI's
        ntasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS", "")
        return not (ntasks.strip() != str(size) or (rank is not None and env.get("SLURM_PROCID", "").strip() != str(rank)))

    def resolve(self, env):
        m = self.name
        nodelist_var = next((v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(v)),
                            "SLURM_JOB_NODELIST")
        ntasks_var = "SLURM_NTASKS" if env.get("SLURM_NTASKS") else "SLURM_STEP_NUM_TASKS"
        _need(env, ("SLURM_PROCID", ntasks_var, "SLURM_LOCALID", "SLURM_NODEID", nodelist_var), m,
              "SLURM_JOB_ID and SLURM_STEP_ID say this is a task of an srun step")
        world, rank = _int(env, ntasks_var, m, 1), _int(env, "SLURM_PROCID", m)
        if env.get("SLURM_STEP_NUM_TASKS") and ntasks_var == "SLURM_NTASKS" and int(env["SLURM_STEP_NUM_TASKS"]) != world:
            raise ClusterEnvError(f"slurm: SLURM_NTASKS={world} contradicts SLURM_STEP_NUM_TASKS={env['SLURM_STEP_NUM_TASKS']}")
        _below(rank, "SLURM_PROCID", world, ntasks_var, m)
        hosts = expand_nodelist(env[nodelist_var])
        nnodes_var = next((v for v in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES") if env.get(v)), None)
        nnodes = _int(env, nnodes_var, m, 1) if nnodes_var else len(hosts)
        if nnodes != len(hosts) and nodelist_var != "SLURM_JOB_NODELIST" or nnodes > len(hosts):
            raise ClusterEnvError(f"slurm: {nnodes_var}={nnodes} contradicts {nodelist_var}={env[nodelist_var]!r} "
                                  f"({len(hosts)} nodes)")
        node = _int(env, "SLURM_NODEID", m)
        _below(node, "SLURM_NODEID", nnodes, nnodes_var or nodelist_var, m)
        local = _int(env, "SLURM_LOCALID", m)
        per_node_var = next((v for v in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE") if env.get(v)), None)
        local_world = None
        if per_node_var:
            counts = tasks_per_node(env[per_node_var])
            if per_node_var == "SLURM_STEP_TASKS_PER_NODE" and sum(counts) != world:
                raise ClusterEnvError(f"slurm: {per_node_var}={env[per_node_var]!r} adds up to {sum(counts)} tasks, "
                                      f"but {ntasks_var}={world}")
            if node < len(counts):
                local_world = counts[node]
                _below(local, "SLURM_LOCALID", local_world, f"{per_node_var}[{node}]", m)
        if world < nnodes:
            raise ClusterEnvError(f"slurm: {ntasks_var}={world} tasks cannot cover {nnodes} nodes ({nnodes_var or nodelist_var})")
        job_id = env["SLURM_JOB_ID"].strip()
        if not job_id.isdigit():
            raise ClusterEnvError(f"slurm: SLURM_JOB_ID={job_id!r} is not a job number")
        port = _port(env, m) or 15000 + int(job_id[-4:])  # as Lightning does: every task derives the same port
        restarts = _int(env, "SLURM_RESTART_COUNT", m) if env.get("SLURM_RESTART_COUNT") else 0
        step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID", "")
        return ClusterEnv(m, "process", world, rank, local, local_world, node, str(nnodes),
                          env.get("MASTER_ADDR", "").strip() or hosts[0], port, restarts, f"{job_id}.{step}",
                          variables=_read(env, ("SLURM_",), ("MASTER_ADDR", "MASTER_PORT")))


PET_NODE_VARS = ("PET_NNODES", "PET_NODE_RANK", "PET_NPROC_PER_NODE", "PET_MASTER_ADDR", "PET_MASTER_PORT",
                 "PET_RDZV_ENDPOINT")


class Kubeflow(Manager):
    """A pod of a Kubeflow PyTorchJob (training-operator v1) or TrainJob (Trainer v2), or of plait's JobSet.

    PyTorchJob (with a Master replica) injects MASTER_ADDR, MASTER_PORT, WORLD_SIZE (= pods x nprocPerNode),
    RANK (= the pod's index, also PET_NODE_RANK), PET_MASTER_ADDR/PORT, PET_NPROC_PER_NODE and PET_NNODES; with
    an elasticPolicy PET_NNODES is MIN:MAX and PET_RDZV_ENDPOINT/BACKEND, PET_MAX_RESTARTS come along. TrainJob
    injects PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT.
    """

    name = "kubeflow"

    def applies(self, env):
        if "PLAIT_RAY_RANK" in env:  # Ray Train sets RANK, WORLD_SIZE, MASTER_ADDR ... in its workers: they are Ray's
            return False
        return any(v in env for v in PET_NODE_VARS) or "RANK" in env or "WORLD_SIZE" in env

    def resolve(self, env):
        if any(env.get(v, "").strip() for v in PET_NODE_VARS):
            return self._nodes(env)
        m = self.name
        _need(env, ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"), m,
              "RANK or WORLD_SIZE says a manager started this process as one rank of a job")
        world, rank = _int(env, "WORLD_SIZE", m, 1), _int(env, "RANK", m)
        _below(rank, "RANK", world, "WORLD_SIZE", m)
        local = _int(env, "LOCAL_RANK", m) if env.get("LOCAL_RANK") else 0
        local_world = _int(env, "LOCAL_WORLD_SIZE", m, 1) if env.get("LOCAL_WORLD_SIZE") else None
        # one process per pod: the pod's index is the rank
        return ClusterEnv(m, "process", world, rank, local, local_world, rank, str(world),
                          env["MASTER_ADDR"].strip(), _port(env, m), job_id=f"{env['MASTER_ADDR'].strip()}-{env['MASTER_PORT']}",
                          detail="PyTorchJob (one process per pod)", variables=_read(env, ("PET_",), (
                              "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")))

    def _nodes(self, env):
        m = self.name
        variables = _read(env, ("PET_",), ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
        endpoint_var = "PET_RDZV_ENDPOINT" if env.get("PET_RDZV_ENDPOINT") else "PET_MASTER_ADDR"
        elastic = endpoint_var == "PET_RDZV_ENDPOINT"
        needed = ("PET_NNODES", "PET_RDZV_ENDPOINT") if elastic else ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR",
                                                                      "PET_MASTER_PORT")
        found = [v for v in PET_NODE_VARS if env.get(v)]
        _need(env, needed, m, f"{', '.join(found)} say{'s' if len(found) == 1 else ''} this pod is one node of a "
              "torchrun-style job")
        text = env["PET_NNODES"].strip()
        lo, sep, hi = text.partition(":")
        if not (lo.isdigit() and (not sep or hi.isdigit())) or int(lo) < 1 or (sep and int(hi) < int(lo)):
            raise ClusterEnvError(f"kubeflow: PET_NNODES={text!r} must be N or MIN:MAX with 1 <= MIN <= MAX")
        max_nodes = int(hi or lo)
        if elastic:
            addr, port = _split_endpoint(env["PET_RDZV_ENDPOINT"], "PET_RDZV_ENDPOINT", m)
        else:
            addr, port = env["PET_MASTER_ADDR"].strip(), _int(env, "PET_MASTER_PORT", m, 1)
        node = _int(env, "PET_NODE_RANK", m) if env.get("PET_NODE_RANK", "").strip() else None
        if node is not None:
            _below(node, "PET_NODE_RANK", max_nodes, "PET_NNODES", m)
        nproc_text = env.get("PET_NPROC_PER_NODE", "").strip()
        nproc = int(nproc_text) if nproc_text.isdigit() else None  # "auto", "gpu", "cpu": decided on the node
        if nproc is not None and nproc < 1:
            raise ClusterEnvError(f"kubeflow: PET_NPROC_PER_NODE={nproc_text!r} must be >= 1 (or auto)")
        world = nproc * max_nodes if nproc and not sep else None
        # PyTorchJob states the same things twice: they must agree
        if env.get("RANK", "").strip() and node is not None and _int(env, "RANK", m) != node:
            raise ClusterEnvError(f"kubeflow: RANK={env['RANK']} contradicts PET_NODE_RANK={node} (a PyTorchJob gives "
                                  "both the pod's index)")
        if env.get("WORLD_SIZE", "").strip() and world is not None and _int(env, "WORLD_SIZE", m, 1) != world:
            raise ClusterEnvError(f"kubeflow: WORLD_SIZE={env['WORLD_SIZE']} contradicts PET_NNODES={text} x "
                                  f"PET_NPROC_PER_NODE={nproc_text} = {world}")
        if env.get("MASTER_ADDR", "").strip() and env.get("PET_MASTER_ADDR", "").strip() and \
                env["MASTER_ADDR"].strip() != env["PET_MASTER_ADDR"].strip():
            raise ClusterEnvError(f"kubeflow: MASTER_ADDR={env['MASTER_ADDR']} contradicts "
                                  f"PET_MASTER_ADDR={env['PET_MASTER_ADDR']}")
        restarts = _int(env, "PET_MAX_RESTARTS", m) if env.get("PET_MAX_RESTARTS", "").strip() else None
        detail = "PyTorchJob" if env.get("MASTER_ADDR") else "TrainJob / JobSet (PET_*)"
        return ClusterEnv(m, "node", world, None, None, nproc, node, text, addr, port, 0,
                          env.get("PET_RDZV_ID", "").strip() or f"{addr}-{port}", env.get("PET_RDZV_BACKEND", "").strip(),
                          restarts, detail + (", elastic" if elastic else ""), variables)


class MPI(Manager):
    """A rank started by mpirun / mpiexec (Open MPI, MPICH, Intel MPI), without torchrun."""

    name = "mpi"

    def applies(self, env):
        return any(v in env for v in ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMI_SIZE", "PMIX_RANK"))

    def resolve(self, env):
        m = self.name
        if any(v in env for v in ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")):
            names = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
            detail, job_vars = "Open MPI", ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE", "OMPI_MCA_orte_hnp_uri")
        elif any(v in env for v in ("PMI_RANK", "PMI_SIZE")):
            names = ("PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
            detail, job_vars = "MPICH / Intel MPI (Hydra)", ("PMI_KVSNAME", "PMI_JOBID", "PMI_ID")
        else:
            raise ClusterEnvError("mpi: PMIX_RANK is set but not the world size; set OMPI_COMM_WORLD_SIZE or PMI_SIZE "
                                  "(or launch with mpirun from Open MPI, MPICH or Intel MPI)")
        _need(env, names, m, f"{next(v for v in names if v in env)} says mpirun started this process")
        size, rank, local, local_size = (_int(env, names[0], m, 1), _int(env, names[1], m), _int(env, names[2], m),
                                         _int(env, names[3], m, 1))
        _below(rank, names[1], size, names[0], m)
        _below(local, names[2], local_size, names[3], m)
        if local_size > size:
            raise ClusterEnvError(f"mpi: {names[3]}={local_size} contradicts {names[0]}={size}")
        if env.get("PMIX_RANK", "").strip().isdigit() and int(env["PMIX_RANK"]) != rank:
            raise ClusterEnvError(f"mpi: PMIX_RANK={env['PMIX_RANK']} contradicts {names[1]}={rank}")
        one_host = local_size == size
        addr = env.get("MASTER_ADDR", "").strip() or ("127.0.0.1" if one_host else "")
        if not addr:
            raise ClusterEnvError(f"mpi: the {size} ranks span several hosts and MPI does not say where rank 0 runs: "
                                  "set MASTER_ADDR to rank 0's host on every rank (mpirun -x MASTER_ADDR=<host> ...)")
        job = next((env[v] for v in job_vars if env.get(v, "").strip()), "")
        port = _port(env, m)
        if port is None:
            if not job:
                raise ClusterEnvError(f"mpi: no job id to derive a port from ({', '.join(job_vars)} unset): set MASTER_PORT "
                                      "on every rank (mpirun -x MASTER_PORT=29500 ...)")
            port = 20000 + zlib.crc32(job.encode()) % 10000  # the same on every rank of this job
        nnodes = -(-size // local_size)
        return ClusterEnv(m, "process", size, rank, local, local_size, rank // local_size, str(nnodes), addr, port, 0,
                          job or f"{addr}-{port}", detail=detail,
                          variables=_read(env, ("OMPI_COMM_WORLD_", "PMI_", "PMIX_RANK", "MPI_LOCAL"),
                                          ("MASTER_ADDR", "MASTER_PORT")))


RAY_VARS = ("PLAIT_RAY_RANK", "PLAIT_RAY_WORLD_SIZE", "PLAIT_RAY_LOCAL_RANK", "PLAIT_RAY_LOCAL_WORLD_SIZE",
            "PLAIT_RAY_NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


class Ray(Manager):
    """A Ray Train worker started by plait's Ray launcher (launch.launcher = 'ray')."""

    name = "ray"

    def applies(self, env):
        return "PLAIT_RAY_RANK" in env

    def resolve(self, env):
        m = self.name
        _need(env, RAY_VARS, m, "PLAIT_RAY_RANK says plait's Ray launcher started this worker")
        world, rank = _int(env, "PLAIT_RAY_WORLD_SIZE", m, 1), _int(env, "PLAIT_RAY_RANK", m)
        _below(rank, "PLAIT_RAY_RANK", world, "PLAIT_RAY_WORLD_SIZE", m)
        local, local_world = _int(env, "PLAIT_RAY_LOCAL_RANK", m), _int(env, "PLAIT_RAY_LOCAL_WORLD_SIZE", m, 1)
        _below(local, "PLAIT_RAY_LOCAL_RANK", local_world, "PLAIT_RAY_LOCAL_WORLD_SIZE", m)
        restarts = _int(env, "PLAIT_RESTART_COUNT", m) if env.get("PLAIT_RESTART_COUNT") else 0
        return ClusterEnv(m, "process", world, rank, local, local_world, _int(env, "PLAIT_RAY_NODE_RANK", m),
                          str(max(1, world // local_world)), env["MASTER_ADDR"], _port(env, m), restarts,
                          env.get("PLAIT_RAY_RUN", ""), variables=_read(env, ("PLAIT_RAY_",), ("MASTER_ADDR", "MASTER_PORT",
                                                                                                  "PLAIT_RESTART_COUNT")))


MANAGERS: list[Manager] = [Torchrun(), Slurm(), Kubeflow(), MPI(), Ray()]

SINGLE = ClusterEnv("none", "process", 1, 0, 0, 1, 0, "1", "127.0.0.1", 0, detail="no workload manager: one process")


def resolve(env: Mapping[str, str] | None = None) -> ClusterEnv:
    """What the first manager (in MANAGERS' order) whose variables are present says; one process if none is."""
    env = os.environ if env is None else env
    for manager in MANAGERS:
        if manager.applies(env):
            return manager.resolve(env)
    return SINGLE


def format_env(e: ClusterEnv) -> str:
    """What `plait env` prints."""
    unknown = "(decided on the node)"
    rows = [
        ("manager", e.manager + (f" ({e.detail})" if e.detail else "")),
        ("level", "this process is one rank" if e.level == "process" else "this process launches the node's ranks"),
        ("world size", unknown if e.world_size is None else e.world_size),
        ("rank", "(assigned by the launcher)" if e.rank is None else e.rank),
        ("local rank", "(assigned by the launcher)" if e.local_rank is None else e.local_rank),
        ("processes on this node", unknown if e.local_world_size is None else e.local_world_size),
        ("node rank", "(assigned by the rendezvous)" if e.node_rank is None else e.node_rank),
        ("nodes", e.nnodes),
        ("master", e.endpoint if e.manager != "none" else "(none)"),
        ("restart count", e.restart_count),
        ("job id", e.job_id or "-"),
    ]
    if e.rdzv_backend or e.max_restarts is not None:
        rows.append(("rendezvous", f"{e.rdzv_backend or 'c10d'}, max restarts {e.max_restarts}"))
    lines = [f"{k:<24} {v}" for k, v in rows]
    if e.variables:
        lines.append("read from:")
        lines += [f"  {k}={v}" for k, v in e.variables.items()]
    return "\n".join(lines)
