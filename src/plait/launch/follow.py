"""A job file's data-parallel degree follows the cluster launch it is written for (plait slurm, plait k8s).

The README's job.toml (`plait config show > job.toml`) says `parallel.dp = 2`, and `parallel.dp = "auto"` is
resolved on the machine that loads the config: on a login node without GPUs that is one process. Neither is what
`--nodes 2 --gpus-per-node 8` means. Unless the command line pins it (`--set parallel.dp=N`), dp becomes what
Layout.resolve makes of the launch's processes (those beside any parameter servers divided by cp x tp x pp, every
other degree kept), keeping the global batch (the trajectory does not depend on dp; the micro batch shrinks when it
must, which changes memory, not the steps).
"""

from __future__ import annotations

from plait.config import Config
from plait.errors import ConfigError
from plait.parallel.layout import dedicated_servers, resized


def pinned_dp(overrides: list[str] | None) -> bool:
    """Whether --set fixes parallel.dp to a number (not "auto")."""
    for s in overrides or []:
        key, _, value = s.partition("=")
        if key.strip() == "parallel.dp" and value.strip().strip("'\"") != "auto":
            return True
    return False


def follow_launch(cfg: Config, world: int, how: str, pinned: bool, say) -> Config:
    """cfg with parallel.dp = what Layout.resolve makes of `world` processes, unless pinned; `say` gets one line."""
    if pinned or world <= 0:
        return cfg
    new = resized(cfg, world, how)
    p, t, dp = cfg.parallel, cfg.train, new.parallel.dp
    if dp == p.dp:
        return cfg
    if t.global_batch_size % dp:
        raise ConfigError(f"{how} gives {world} processes, so parallel.dp would be {dp}, which does not divide "
                          f"train.global_batch_size ({t.global_batch_size}); set train.global_batch_size to a multiple "
                          f"of {dp}, or pin the layout with --set parallel.dp=N")
    note = ""
    if t.global_batch_size % (t.micro_batch_size * dp):
        new.train.micro_batch_size = t.global_batch_size // dp
        note = f", train.micro_batch_size {t.micro_batch_size} -> {new.train.micro_batch_size} (the global batch kept)"
    per = (f"cp {p.cp} x " if p.cp > 1 else "") + f"tp {p.tp} x pp {p.pp}"
    servers = dedicated_servers(cfg)
    say(f"parallel.dp {p.dp} -> {dp} to fill {how} ({world} processes" + (f" - {servers} parameter servers" if servers
        else "") + f" / {per}){note}; pin it with --set parallel.dp=N")
    return new


__all__ = ["follow_launch", "pinned_dp"]
