"""Environment resolution (plait.launch.env): recorded environments of each manager, several nodes and ranks,
compressed node lists; partial and contradictory ones fail naming the variables; who starts what (role)."""

import json
import subprocess
import sys
import zlib

import pytest

from plait.config import load_config
from plait.launch.env import ClusterEnvError, expand_nodelist, resolve, tasks_per_node
from plait.launch.role import job_role

# ---- recorded environments (trimmed to the variables the managers set)

# srun -N2 -n2 on the test cluster (Slurm 22.05), task 1
SLURM_TASK1 = {
    "SLURMD_NODENAME": "n2", "SLURM_CLUSTER_NAME": "plaittest", "SLURM_CPUS_ON_NODE": "1", "SLURM_GTIDS": "1",
    "SLURM_JOBID": "1", "SLURM_JOB_ID": "1", "SLURM_JOB_NAME": "bash", "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURM_JOB_NUM_NODES": "2", "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1", "SLURM_LOCALID": "0", "SLURM_NNODES": "2",
    "SLURM_NODEID": "1", "SLURM_NODELIST": "n[1-2]", "SLURM_NPROCS": "2", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
    "SLURM_STEPID": "0", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_TASKS_PER_NODE": "1(x2)",
}
# the batch script of the same kind of job: not a task of a step
SLURM_BATCH = {k: v for k, v in SLURM_TASK1.items() if not k.startswith("SLURM_STEP")} | {"SLURM_PROCID": "0", "SLURM_NODEID": "0"}
# srun -N4 -n16 across gpu[01-03],gpu07 (a requeued job), task 13: node 3, local rank 1
SLURM_BIG = {
    "SLURM_JOB_ID": "4417213", "SLURM_STEP_ID": "2", "SLURM_PROCID": "13", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
    "SLURM_NODEID": "3", "SLURM_JOB_NODELIST": "gpu[01-03,07]", "SLURM_STEP_NODELIST": "gpu[01-03,07]",
    "SLURM_STEP_NUM_NODES": "4", "SLURM_STEP_NUM_TASKS": "16", "SLURM_STEP_TASKS_PER_NODE": "4(x4)",
    "SLURM_NNODES": "4", "SLURM_RESTART_COUNT": "2",
}
# a torchrun worker (2 nodes x 2), as torch.distributed.run sets it
TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "plait-run", "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "3",
    "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",
    "ROLE_RANK": "3", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True",
}
# Kubeflow PyTorchJob (training-operator v1.9, nprocPerNode "4", Master + 2 Workers): worker-1's pod
PYTORCHJOB_WORKER1 = {
    "PYTHONUNBUFFERED": "1", "MASTER_PORT": "23456", "PET_MASTER_PORT": "23456", "MASTER_ADDR": "job-master-0",
    "PET_MASTER_ADDR": "job-master-0", "WORLD_SIZE": "12", "RANK": "2", "PET_NODE_RANK": "2", "PET_NPROC_PER_NODE": "4",
    "PET_NNODES": "3",
}
# ... with an elasticPolicy (Workers only, minReplicas 1, maxReplicas 3)
PYTORCHJOB_ELASTIC = {
    "PYTHONUNBUFFERED": "1", "PET_NPROC_PER_NODE": "2", "PET_RDZV_ENDPOINT": "job-worker-0:23456", "PET_RDZV_BACKEND": "c10d",
    "PET_NNODES": "1:3", "PET_MAX_RESTARTS": "3",
}
# Kubeflow Trainer v2 TrainJob on torch-distributed: node 1 of 2
TRAINJOB_NODE1 = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "1",
                  "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29500"}
# a PyTorchJob from before nprocPerNode (one process per pod)
PYTORCHJOB_OLD = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "1"}
# mpirun -n 2 (Open MPI 4.1), rank 1, one host
OMPI_RANK1 = {
    "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1",
    "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_MCA_ess_base_jobid": "1131675649",
    "OMPI_MCA_orte_hnp_uri": "1131675648.0;tcp://192.0.2.2:59659", "PMIX_NAMESPACE": "1131675649", "PMIX_RANK": "1",
}
# mpiexec (MPICH / Intel MPI Hydra) -n 8 over 2 hosts, rank 5
HYDRA_RANK5 = {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4", "PMI_FD": "7",
               "MASTER_ADDR": "host-a", "PMI_KVSNAME": "kvs_2188_0"}
# a Ray Train worker under plait's Ray launcher (Ray Train sets the torch variables too)
RAY_RANK1 = {"PLAIT_RAY_RANK": "1", "PLAIT_RAY_WORLD_SIZE": "2", "PLAIT_RAY_LOCAL_RANK": "1", "PLAIT_RAY_LOCAL_WORLD_SIZE": "2",
             "PLAIT_RAY_NODE_RANK": "0", "PLAIT_RAY_RUN": "run-1a2b", "PLAIT_RESTART_COUNT": "1",
             "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "192.0.2.2", "MASTER_PORT": "41000"}


def mpi_port(job_id: str) -> int:
    """The port every rank of one MPI job derives from its job id (no MASTER_PORT given)."""
    return 20000 + zlib.crc32(job_id.encode()) % 10000


def fields(e):
    return (e.manager, e.level, e.world_size, e.rank, e.local_rank, e.local_world_size, e.node_rank, e.nnodes,
            e.master_addr, e.master_port, e.restart_count)


@pytest.mark.parametrize("env, expected", [
    ({}, ("none", "process", 1, 0, 0, 1, 0, "1", "127.0.0.1", 0, 0)),
    ({"MASTER_ADDR": "x", "MASTER_PORT": "1", "PATH": "/bin"}, ("none", "process", 1, 0, 0, 1, 0, "1", "127.0.0.1", 0, 0)),
    (TORCHRUN, ("torchrun", "process", 4, 3, 1, 2, 1, "2", "10.0.0.1", 29500, 1)),
    (SLURM_TASK1, ("slurm", "process", 2, 1, 0, 1, 1, "2", "n1", 15001, 0)),
    (SLURM_TASK1 | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"},
     ("slurm", "process", 2, 1, 0, 1, 1, "2", "127.0.0.1", 29400, 0)),
    (SLURM_BIG, ("slurm", "process", 16, 13, 1, 4, 3, "4", "gpu01", 15000 + 7213, 2)),
    (SLURM_BATCH, ("none", "process", 1, 0, 0, 1, 0, "1", "127.0.0.1", 0, 0)),
    (PYTORCHJOB_WORKER1, ("kubeflow", "node", 12, None, None, 4, 2, "3", "job-master-0", 23456, 0)),
    (PYTORCHJOB_ELASTIC, ("kubeflow", "node", None, None, None, 2, None, "1:3", "job-worker-0", 23456, 0)),
    (TRAINJOB_NODE1, ("kubeflow", "node", 16, None, None, 8, 1, "2", "job-node-0-0.job", 29500, 0)),
    (TRAINJOB_NODE1 | {"PET_NPROC_PER_NODE": "auto"}, ("kubeflow", "node", None, None, None, None, 1, "2",
                                                      "job-node-0-0.job", 29500, 0)),
    (PYTORCHJOB_OLD, ("kubeflow", "process", 3, 1, 0, None, 1, "3", "job-master-0", 23456, 0)),
    (OMPI_RANK1, ("mpi", "process", 2, 1, 1, 2, 0, "1", "127.0.0.1", mpi_port("1131675649"), 0)),
    (HYDRA_RANK5, ("mpi", "process", 8, 5, 1, 4, 1, "2", "host-a", mpi_port("kvs_2188_0"), 0)),
    (RAY_RANK1, ("ray", "process", 2, 1, 1, 2, 0, "1", "192.0.2.2", 41000, 1)),
    # torchrun started inside a Slurm job (plait's job.sbatch): the worker is torchrun's
    (SLURM_TASK1 | TORCHRUN, ("torchrun", "process", 4, 3, 1, 2, 1, "2", "10.0.0.1", 29500, 1)),
    # mpirun inside an allocation: Slurm's variables describe mpirun's daemons (1 task), the ranks are MPI's
    (SLURM_TASK1 | {"SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0", "SLURM_NODEID": "0",
                    "SLURM_STEP_TASKS_PER_NODE": "1"} | OMPI_RANK1,
     ("mpi", "process", 2, 1, 1, 2, 0, "1", "127.0.0.1", mpi_port("1131675649"), 0)),
])
def test_each_manager_resolves_rank_world_and_master(env, expected):
    assert fields(resolve(env)) == expected


def test_job_ids_name_the_same_run_on_every_rank():
    assert resolve(SLURM_BIG).job_id == "4417213.2"
    assert resolve(TORCHRUN).job_id == "plait-run"
    assert resolve(OMPI_RANK1).job_id == resolve(OMPI_RANK1 | {"OMPI_COMM_WORLD_RANK": "0", "PMIX_RANK": "0",
                                                               "OMPI_COMM_WORLD_LOCAL_RANK": "0"}).job_id


@pytest.mark.parametrize("text, hosts", [
    ("n[1-3,7]", ["n1", "n2", "n3", "n7"]),
    ("n1", ["n1"]),
    ("gpu[01-03,10]", ["gpu01", "gpu02", "gpu03", "gpu10"]),
    ("a[1-2],b,c[08-10]", ["a1", "a2", "b", "c08", "c09", "c10"]),
    ("rack[1-2]-node[1-2]", ["rack1-node1", "rack1-node2", "rack2-node1", "rack2-node2"]),
    ("node-[001-003]", ["node-001", "node-002", "node-003"]),
])
def test_compressed_node_lists_expand_like_scontrol(text, hosts):
    assert expand_nodelist(text) == hosts


def test_node_lists_agree_with_scontrol_where_installed(tmp_path):
    import os
    import shutil

    if shutil.which("scontrol") is None:
        pytest.skip("scontrol is not installed (apt-get install slurm-client)")
    conf = tmp_path / "slurm.conf"  # `scontrol show hostnames` reads a config but asks no controller
    conf.write_text("ClusterName=x\nSlurmctldHost=localhost\nNodeName=n1\nPartitionName=p Nodes=n1\n")
    for text in ("n[1-3,7]", "gpu[01-03,10]", "a[1-2],b,c[08-10]", "rack[1-2]-node[1-2]"):
        out = subprocess.run(["scontrol", "show", "hostnames", text], capture_output=True, text=True,
                             env={**os.environ, "SLURM_CONF": str(conf)})
        assert out.returncode == 0, out.stderr
        assert expand_nodelist(text) == out.stdout.split()


def test_tasks_per_node_form():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ClusterEnvError, match="tasks per node"):
        tasks_per_node("2x3")


@pytest.mark.parametrize("env, names", [
    # partial: the manager's marker is there, some of what it always sets is not
    ({k: v for k, v in SLURM_TASK1.items() if k != "SLURM_PROCID"}, ["SLURM_PROCID"]),
    ({k: v for k, v in SLURM_TASK1.items() if k not in ("SLURM_LOCALID", "SLURM_NODEID")}, ["SLURM_LOCALID", "SLURM_NODEID"]),
    ({"RANK": "1"}, ["WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]),
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "0"}, ["WORLD_SIZE", "LOCAL_RANK"]),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, ["OMPI_COMM_WORLD_LOCAL_RANK"]),
    ({"PET_NNODES": "2", "PET_MASTER_ADDR": "h", "PET_MASTER_PORT": "1"}, ["PET_NODE_RANK"]),
    ({"PMIX_RANK": "0"}, ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"]),
    # contradictory
    (SLURM_TASK1 | {"SLURM_PROCID": "2"}, ["SLURM_PROCID=2", "SLURM_NTASKS=2"]),
    (SLURM_TASK1 | {"SLURM_NTASKS": "3"}, ["SLURM_NTASKS=3", "SLURM_STEP_NUM_TASKS=2"]),
    (SLURM_TASK1 | {"SLURM_NODEID": "2"}, ["SLURM_NODEID=2"]),
    (SLURM_TASK1 | {"SLURM_STEP_NODELIST": "n[1-3"}, ["n[1-3", "unbalanced"]),
    (SLURM_BIG | {"SLURM_LOCALID": "4"}, ["SLURM_LOCALID=4", "SLURM_STEP_TASKS_PER_NODE"]),
    (PYTORCHJOB_WORKER1 | {"RANK": "1"}, ["RANK=1", "PET_NODE_RANK=2"]),
    (PYTORCHJOB_WORKER1 | {"WORLD_SIZE": "3"}, ["WORLD_SIZE=3", "PET_NNODES=3", "PET_NPROC_PER_NODE=4"]),
    (TRAINJOB_NODE1 | {"PET_NODE_RANK": "2"}, ["PET_NODE_RANK=2", "PET_NNODES=2"]),
    (PYTORCHJOB_ELASTIC | {"PET_NNODES": "3:1"}, ["PET_NNODES='3:1'"]),
    (PYTORCHJOB_OLD | {"RANK": "3"}, ["RANK=3", "WORLD_SIZE=3"]),
    (OMPI_RANK1 | {"PMIX_RANK": "0"}, ["PMIX_RANK=0", "OMPI_COMM_WORLD_RANK=1"]),
    (OMPI_RANK1 | {"OMPI_COMM_WORLD_LOCAL_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, ["MASTER_ADDR"]),
    (HYDRA_RANK5 | {"PMI_RANK": "8"}, ["PMI_RANK=8", "PMI_SIZE=8"]),
    (RAY_RANK1 | {"PLAIT_RAY_RANK": "2"}, ["PLAIT_RAY_RANK=2"]),
    (TORCHRUN | {"LOCAL_RANK": "2"}, ["LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2"]),
])
def test_partial_or_contradictory_environments_name_the_variables(env, names):
    with pytest.raises(ClusterEnvError) as e:
        resolve(env)
    for name in names:
        assert name in str(e.value), str(e.value)


def _cfg(*overrides):
    return load_config(None, ["parallel.dp=4", "train.global_batch_size=32", "train.micro_batch_size=8", *overrides])


def test_role_who_starts_what():
    assert job_role(_cfg(), {}).worker is False  # plain shell: plait's launcher
    assert job_role(_cfg(), TORCHRUN).worker is True
    assert job_role(_cfg(), SLURM_BIG).worker is True  # srun -n 16: every task is a rank
    assert job_role(_cfg(), OMPI_RANK1).worker is True
    one = SLURM_TASK1 | {"SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0", "SLURM_NODEID": "0",
                         "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NODELIST": "n1", "SLURM_STEP_TASKS_PER_NODE": "1"}
    assert job_role(_cfg(), one).worker is False  # srun -n 1 plait train: plait launches the layout locally
    # plait's job.sbatch: srun --ntasks-per-node=1 plait train --set launch.nnodes=2 ...: this task is node 1's launcher
    role = job_role(_cfg("launch.nnodes=2", "launch.rdzv_endpoint='127.0.0.1:15001'"), SLURM_TASK1)
    assert (role.worker, role.cfg.launch.node_rank) == (False, 1)


def test_role_of_a_kubeflow_pod_takes_the_operators_placement():
    role = job_role(_cfg("parallel.dp=16", "train.global_batch_size=128"), TRAINJOB_NODE1)
    lc = role.cfg.launch
    assert (role.worker, lc.nnodes, lc.node_rank, lc.nproc_per_node, lc.rdzv_endpoint) == (
        False, "2", 1, 8, "job-node-0-0.job:29500")
    role = job_role(_cfg("parallel.dp=6", "train.global_batch_size=48", "train.micro_batch_size=8"), PYTORCHJOB_ELASTIC)
    assert (role.cfg.launch.nnodes, role.cfg.launch.max_restarts, role.cfg.elastic) == ("1:3", 3, True)


@pytest.mark.parametrize("env, message", [
    (TRAINJOB_NODE1, "the layout needs dp(4) * tp(1) * pp(1) = 4 processes but kubeflow's PET_NNODES(2) * "
                     "PET_NPROC_PER_NODE(8) = 16"),
    (SLURM_TASK1 | {"SLURM_STEP_TASKS_PER_NODE": "2,1", "SLURM_NTASKS": "3", "SLURM_STEP_NUM_TASKS": "3",
                    "SLURM_LOCALID": "0"}, None),
])
def test_a_manager_that_contradicts_the_layout_is_named_with_both_numbers(env, message):
    from plait.errors import ConfigError
    from plait.launch.job import fit

    if message:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
            job_role(_cfg(), env)
    else:  # Slurm gives 3 tasks, the layout needs 4: the worker stops before training
        role = job_role(_cfg(), env)
        assert role.worker
        with pytest.raises(ConfigError, match=r"needs dp\(4\) \* tp\(1\) \* pp\(1\) = 4 processes but Slurm's SLURM_NTASKS = 3"):
            fit(role.cfg, role.env)


def test_plait_env_prints_what_it_resolved(tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI", "PET_", "TORCHELASTIC_"))}
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    r = subprocess.run([sys.executable, "-m", "plait", "env", "--json"], capture_output=True, text=True,
                       env={**env, **SLURM_BIG})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["manager"], out["rank"], out["world_size"], out["node_rank"], out["master_addr"], out["plait_train"]) == (
        "slurm", 13, 16, 3, "gpu01", "worker")
    assert out["variables"]["SLURM_JOB_NODELIST"] == "gpu[01-03,07]"
    r = subprocess.run([sys.executable, "-m", "plait", "env"], capture_output=True, text=True, env={**env, **TRAINJOB_NODE1})
    assert r.returncode == 0, r.stderr
    assert "kubeflow (TrainJob / JobSet (PET_*))" in r.stdout and "node rank                1" in r.stdout
    r = subprocess.run([sys.executable, "-m", "plait", "env"], capture_output=True, text=True,
                       env={**env, **SLURM_TASK1, "SLURM_PROCID": "5"})
    assert r.returncode == 2 and "SLURM_PROCID=5 contradicts SLURM_NTASKS=2" in r.stderr
