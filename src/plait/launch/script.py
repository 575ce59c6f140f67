"""`plait launch [CONFIG] [--set ...] [--out DIR] script.py [args...]`: a user's own script on plait's launcher.

The layout's processes start through torchrun's elastic agent with the same environment resolution as
`plait train` (launch.* keys, plait.launch.env); each runs `python script.py args...` with torch's
variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...) plus PLAIT_CONFIG (the resolved config.toml,
written to the run directory first) and PLAIT_RUN_DIR. Inside, `plait.parallelize(model)` reads PLAIT_CONFIG.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import elastic_launch

from plait.config import Config, dump_config, load_config, validate_config
from plait.errors import ConfigError
from plait.launch.forkserver import worker_env
from plait.launch.torchrun import _quiet_agent, launch_config, report_failure
from plait.parallel.schemes import check_config
from plait.rundir import timestamped

CONFIG_ENV = "PLAIT_CONFIG"
RUN_DIR_ENV = "PLAIT_RUN_DIR"


def split_args(rest: list[str]) -> tuple[str | None, str, list[str]]:
    """(CONFIG or None, script, script's args) from what follows `plait launch`'s own flags."""
    config = rest[0] if rest and rest[0].endswith(".toml") else None
    rest = rest[1:] if config else rest
    if not rest:
        raise ConfigError("plait launch needs a script: plait launch [CONFIG] [--set launch.KEY=VALUE ...] script.py "
                          "[args...]")
    script = rest[0]
    if not script.endswith(".py") or not Path(script).is_file():
        raise ConfigError(f"plait launch {script}: not a Python file here; give the path of your script (script.py)")
    return config, script, rest[1:]


def refuse_roles(cfg: Config) -> None:
    """A parameter server's ranks have roles (servers that do not train) that only plait's own loop runs."""
    if cfg.parallel.sync == "ps":
        raise ConfigError("plait.parallelize: parallel.sync = 'ps' gives ranks roles (servers that do not train) "
                          "that only plait train runs; use parallel.sync='allreduce' or 'gossip' in your own loop")


def check_script_job(cfg: Config):
    """The layout's arithmetic and every scheme's keys, before any process starts; the model is the script's."""
    validate_config(cfg)
    refuse_roles(cfg)
    return check_config(cfg, model_known=False)


def launch_script(cfg: Config, run_dir: Path, script: str, args: list[str]) -> int:
    """Write run_dir/config.toml and run the script in the layout's processes; returns the CLI's exit code."""
    check_script_job(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(dump_config(cfg))
    _quiet_agent()
    # the agent's own lines about stopping workers: report_failure says what failed, the script said why
    logging.getLogger("torch.distributed.elastic.multiprocessing").setLevel(logging.CRITICAL)
    os.environ.update(worker_env(cfg))
    os.environ[CONFIG_ENV] = str((run_dir / "config.toml").resolve())
    os.environ[RUN_DIR_ENV] = str(run_dir.resolve())
    try:
        elastic_launch(launch_config(cfg, run_dir), sys.executable)(script, *args)
    except ChildFailedError as e:
        return report_failure(e)
    return 0


def cmd_launch(a) -> int:
    """`plait launch`'s verb (its parser: plait.launch.cli)."""
    config, script, args = split_args(a.rest)
    cfg = load_config(config, a.set)
    check_script_job(cfg)  # before the run dir exists: a bad layout leaves nothing behind
    out = a.out or timestamped("launch")
    return launch_script(cfg, out, script, args)
