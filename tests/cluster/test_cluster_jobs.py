"""`plait cluster run`'s jobs at every size the policy may give them, without starting one: the jobs file checked
through Layout.resolve, the `plait train` command of a (re)start, and the Slurm queue's config.toml and job.sbatch.
A cp2, tp2 or pp2 job keeps that degree at every size; dp alone follows the slots (issue 56 item 5)."""

from __future__ import annotations

import re
import subprocess

import pytest

import plait.cluster.run as run
from plait.cluster.run import LocalCluster, SlurmQueue, read_jobs
from plait.config import load_config
from plait.errors import ConfigError
from plait.parallel.layout import Layout

SETS = ["model.layers=2", "train.global_batch_size=8", "train.micro_batch_size=4", "parallel.dp=1"]


def jobs_file(tmp_path, axis: str, extra: str = "min_procs = 2\nmax_procs = 4\n"):
    sets = ", ".join(f'"{s}"' for s in [*SETS, f"parallel.{axis}=2"])
    path = tmp_path / "jobs.toml"
    path.write_text(f'[[job]]\nname = "j"\nset = [{sets}]\n{extra}')
    return path


def settings(command: list[str]) -> list[str]:
    return [command[i + 1] for i, a in enumerate(command) if a == "--set"]


@pytest.mark.parametrize("axis", ["cp", "tp", "pp"])
def test_a_local_job_keeps_its_degree_at_every_size(tmp_path, axis):
    (spec,) = read_jobs(jobs_file(tmp_path, axis), slots=4)
    assert (spec.min_procs, spec.max_procs, spec.model_parallel) == (2, 4, 2)  # grows by whole replicas
    assert read_jobs(jobs_file(tmp_path, axis, extra=""), slots=4)[0].min_procs == 2  # default: one replica
    cluster = LocalCluster([spec], 4, "fifo", tmp_path / "out")
    for procs, dp in ((2, 1), (4, 2)):
        command = cluster._command(cluster.jobs["j"], procs)
        assert settings(command)[-2:] == ["parallel.dp='auto'", f"launch.nproc_per_node={procs}"]
        cfg = load_config(None, settings(command))  # as the run loads it
        assert (cfg.parallel.dp, getattr(cfg.parallel, axis), Layout.from_config(cfg).world_size) == (dp, 2, procs)


def test_sizes_no_whole_dp_fits_are_refused_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="^" + re.escape(
            f"{tmp_path / 'jobs.toml'}, job 1 (j): min_procs=2, max_procs=3 must satisfy 1 <= min <= max <= --slots 4, "
            "max - min a multiple of cp x tp x pp = 2")):
        read_jobs(jobs_file(tmp_path, "cp", extra="min_procs = 2\nmax_procs = 3\n"), slots=4)
    with pytest.raises(ConfigError, match="^" + re.escape(
            f"{tmp_path / 'jobs.toml'}, job 1 (j) on 3 processes: no whole parallel.dp fits 3 slots = 3 processes: "
            "dp * cp(2) * tp(1) * pp(1) = 3 leaves dp = 3 / 2; give the job a multiple of 2 processes, or change "
            "parallel.cp; or change min_procs/max_procs")):
        read_jobs(jobs_file(tmp_path, "cp", extra="min_procs = 3\nmax_procs = 3\n"), slots=4)


@pytest.mark.parametrize("axis", ["cp", "tp", "pp"])
def test_a_slurm_queue_job_keeps_its_degree_on_the_nodes_it_gets(tmp_path, axis, monkeypatch):
    submitted = []

    def sbatch(args, **kwargs):  # no Slurm here: what would be submitted is what the test reads
        submitted.append(args)
        return subprocess.CompletedProcess(args, 0, stdout="42\n", stderr="")

    monkeypatch.setattr(run.subprocess, "run", sbatch)
    (spec,) = read_jobs(jobs_file(tmp_path, axis), slots=4)
    queue = SlurmQueue([spec], 4, "fifo", tmp_path / "out")
    j = queue.jobs["j"]
    queue._start(j, 4, [0, 1, 2, 3], 0.0)
    assert submitted == [["sbatch", "--parsable", str(j.run_dir / "job.sbatch")]]
    assert "#SBATCH --nodes=4\n" in (j.run_dir / "job.sbatch").read_text()
    cfg = load_config(j.run_dir / "config.toml")
    assert (cfg.parallel.dp, getattr(cfg.parallel, axis), Layout.from_config(cfg).world_size) == (2, 2, 4)
