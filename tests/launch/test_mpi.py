"""mpirun -n 2 plait train: one job formed from Open MPI's variables, without torchrun, on the torchrun weights."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from launch_helpers import run_weights

from helpers import ENV, max_diff


def test_mpirun_forms_one_job_without_torchrun(sgd_job, sgd_reference, tmp_path):
    if shutil.which("mpirun") is None:
        pytest.skip("needs Open MPI's mpirun (apt-get install openmpi-bin; .ci/run does it)")
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    run = tmp_path / "run"
    r = subprocess.run(["mpirun", *root, "--oversubscribe", "-n", "2", "-x", "OMP_NUM_THREADS", "-x", "PYTHONUNBUFFERED",
                        sys.executable, "-m", "plait", "train", str(sgd_job), "--out", str(run)],
                       capture_output=True, text=True, env={k: v for k, v in ENV.items() if k != "GLOO_SOCKET_IFNAME"},
                       timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "TORCHELASTIC" not in r.stdout + r.stderr
    session = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert (session["manager"], session["world_size"]) == ("mpi", 2)
    assert max_diff(sgd_reference, run_weights(run)) <= 1e-5
