import os
from pathlib import Path

from plait.parallel.schemes import implementation_modules  # declarations only: no torch

# Before anything imports torch: its thread pool reads OMP_NUM_THREADS once.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
# The suite starts well over a thousand Python processes (plait's launchers, fork servers, servers, scripts), each of
# which imports 100+ of plait's modules: where PYTHONDONTWRITEBYTECODE is set (some sandboxes set it for everything),
# every one of them compiles those modules from source again (~0.15 s of CPU each). The test processes' children may
# cache them (__pycache__/ is gitignored; a source edited meanwhile is recompiled, its mtime is checked).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
# The ranks of plait.testing (the session's pools, run_distributed, a test's own RankPool) are forked from a warm
# server of each pytest worker that imported torch, the trainer and these once: a spawned rank spent ~2-4 s of CPU on
# its imports, and the pools restart their ranks every 25 tasks. A test may set its own (RankPool(warm=...)).
# Every scheme's implementation and what the tasks import after them (checkpoint state dicts, pipelining, figures) are
# imported there too: imported in each rank instead, they took 12 % of a compat-cells run's time.
os.environ.setdefault("PLAIT_WARM_RANKS", ",".join([
    "plait.train.trainer", "helpers", "transformers", "torch._dynamo", "torchao", "bitsandbytes",
    "plait.parallel.assemble", *implementation_modules(),
    "torch.distributed.checkpoint.state_dict", "torch.distributed.pipelining", "matplotlib.pyplot"]))
# The engine's compiled attention kernels (plait.serve.engine.kernels, on by default) are built once per machine,
# about 30 s on two cores: the suite's engines keep the plain-torch attention, and
# tests/serve/test_engine.py builds (or loads) the kernels and checks them against that attention and transformers.
os.environ["PLAIT_KERNELS"] = "off"
# What plait caches (the tokenized standard library) goes to this session's own folder, not ~/.cache: no test sees
# what an earlier session left, and the processes of this one share one copy.
if "PLAIT_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["PLAIT_CACHE"] = tempfile.mkdtemp(prefix="plait-test-cache-")
    atexit.register(shutil.rmtree, os.environ["PLAIT_CACHE"], True)

import pytest  # noqa: E402

from plait.testing import RankPool  # noqa: E402

# `make test` runs the suite on two pytest-xdist workers, a file at a time (--dist loadfile: a file's module and
# session fixtures are built once, on one worker). The modules that take longest (the seconds
# beside each) are handed out first, so that the two workers finish together instead of one ending on a long file.
# A file missing here keeps its place after them; the order is a schedule only, never a test's precondition.
LONGEST_FIRST = [  # seconds: each file's test time (setup + call + teardown) in a whole 2-worker run (warm ranks)
    "tests/train/test_faults.py",                 # 137
    "tests/launch/test_ray.py",                   # 114
    "tests/test_docs_run.py",                     # 106
    "tests/launch/test_slurm.py",                 # 104
    "tests/plan/test_compat_cells.py",            # 91
    "tests/parallel/test_equivalence.py",         # 75
    "tests/plan/test_plan.py",                    # 72
    "tests/parallel/test_offload.py",             # 66
    "tests/test_gpu_check.py",                    # 53
    "tests/parallel/test_context.py",             # 42
    "tests/launch/test_own_loop.py",              # 42
    "tests/parallel/test_deepfm_layouts.py",      # 42
    "tests/launch/test_k8s.py",                   # 40
    "tests/launch/test_netns.py",                 # 39
    "tests/test_cli.py",                          # 39
    "tests/ps/test_ps.py",                        # 39
    "tests/parallel/test_lora_tp.py",             # 38
    "tests/cluster/test_cluster_run.py",          # 36
    "tests/federated/test_fed_network.py",        # 31
    "tests/parallel/test_expert.py",              # 28
    "tests/tune/test_tune_warm.py",               # 27
    "tests/serve/test_serve_device.py",           # 26
    "tests/parallel/test_llama_layouts.py",       # 26
    "tests/audit/test_audit.py",                  # 24
    "tests/tune/test_tune.py",                    # 23
    "tests/plan/test_auto_layout.py",             # 22
    "tests/parallel/test_shard_load.py",          # 21
    "tests/parallel/test_zero_compression.py",    # 20
    "tests/test_examples.py",                     # 20
    "tests/parallel/test_zero.py",                # 20
    "tests/serve/test_serve_replicas.py",         # 20
    "tests/launch/test_resume.py",                # 19
    "tests/serve/test_serve_tp.py",               # 18
    "tests/serve/test_serve_autoscale.py",        # 18
    "tests/test_api.py",                          # 18
    "tests/export/test_edge_export.py",           # 17
    "tests/parallel/test_compression_layouts.py", # 17
    "tests/finetune/test_adamw8bit.py",           # 16
    "tests/finetune/test_progressive.py",         # 16
    "tests/report/test_report_chromium.py",       # 15
    "tests/parallel/test_finetune_pipeline.py",   # 15
    "tests/federated/test_fed_poisoning.py",      # 15
    "tests/train/test_trainer.py",                # 15
    "tests/parallel/test_pipeline_zero.py",       # 14
    "tests/ps/test_ps_elastic.py",                # 13
    "tests/test_testing.py",                      # 13
]


def pytest_collection_modifyitems(config, items):
    rank = {f: i for i, f in enumerate(LONGEST_FIRST)}
    root = Path(config.rootpath)
    items.sort(key=lambda item: rank.get(Path(item.path).relative_to(root).as_posix(), len(rank)))  # stable


@pytest.fixture(autouse=True)
def no_leaked_env():
    """A test must not leave torch.distributed's environment variables behind."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
    before = {k: os.environ.get(k) for k in keys}
    yield
    after = {k: os.environ.get(k) for k in keys}
    assert before == after, f"environment leaked: {before} -> {after}"


@pytest.fixture(autouse=True)
def no_process_group():
    """The test process itself never joins a process group; ranks live in the pool."""
    import torch.distributed as dist

    yield
    assert not dist.is_initialized(), "a test left the default process group initialised"


# Ranks are shared by the whole session; a task that fails restarts them, and so do the tests after 10 tasks: each
# task's process groups stay in the ranks with their gloo threads (RankPool's recycle_after; a pool that ran all its
# tasks once carried 1000 threads a rank, ~30 of them running). Forked warm, fresh ranks cost a fraction of a second.
# Between tests only: a test may register a module in the ranks for its later tasks.
POOLS: list[RankPool] = []


@pytest.fixture(scope="session")
def pool2():
    with RankPool(2, timeout_s=90, recycle_after=10) as pool:
        POOLS.append(pool)
        yield pool


@pytest.fixture(scope="session")
def pool4():
    with RankPool(4, timeout_s=120, recycle_after=10) as pool:
        POOLS.append(pool)
        yield pool


SEEN: dict[int, int] = {}  # each pool's tasks_run when the test before began


@pytest.fixture(autouse=True)
def recycle_pools():
    """Before each test, a pool whose ranks ran no task during the test before stops them: an idle rank holding earlier
    tasks' gloo groups keeps using CPU (a 4-rank pool after 10 tasks: 0.14 cores, after 20: 0.27), through the long
    end-to-end tests too. The next test that needs them starts them again, warm. (Idle for a whole test, not "this
    test names no pool": tests that pick their pool with request.getfixturevalue name none.)"""
    for pool in POOLS:
        idle = SEEN.get(id(pool)) == pool.tasks_run
        if pool.started and idle:
            pool.close()
        else:
            pool.recycle_if_due()
        SEEN[id(pool)] = pool.tasks_run


@pytest.fixture(scope="session")
def tiny_text(tmp_path_factory) -> Path:
    """A small text corpus from a few stdlib modules (a folder, so it splits by file)."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    out = tmp_path_factory.mktemp("corpus")
    for name in ("textwrap.py", "string.py", "bisect.py", "heapq.py", "keyword.py", "colorsys.py", "fnmatch.py",
                 "shlex.py", "glob.py", "copy.py"):
        (out / name).write_text((root / name).read_text())
    return out


@pytest.fixture(scope="session")
def job(tmp_path_factory, tiny_text) -> Path:
    """A tiny 2-process GPT job (TOML file) with a checkpoint every 3 steps, for fault-injection tests."""
    from helpers import TINY_GPT
    from plait.config import dump_config, load_config

    cfg = load_config(None, TINY_GPT + ["data.name='text'", f"data.path='{tiny_text}'", "train.steps=10",
                                        "checkpoint.every=3", "checkpoint.keep=3", "log.every=1",
                                        "optim.schedule='constant'", "launch.timeout_s=60"])
    path = tmp_path_factory.mktemp("job") / "job.toml"
    path.write_text(dump_config(cfg))
    return path


@pytest.fixture(scope="session")
def straight_run(job, tmp_path_factory) -> Path:
    """`job` run straight through (a run dir; tests must not change it)."""
    from helpers import plait

    run = tmp_path_factory.mktemp("straight") / "run"
    r = plait("train", job, "--out", run)
    assert r.returncode == 0, r.stdout + r.stderr
    return run


@pytest.fixture(scope="session")
def uninterrupted(straight_run) -> dict:
    """The exported weights of `job` run straight through."""
    from helpers import weights

    return weights(straight_run)
