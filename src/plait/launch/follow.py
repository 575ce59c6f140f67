"""A job file's data-parallel degree follows the cluster launch it is written for (plait slurm, plait k8s).

The README's job.toml (`plait config show > job.toml`) says `parallel.dp = 2`, and `parallel.dp = "auto"` is
resolved on the machine that loads the config: on a login node without GPUs that is one process. Neither is what
`--nodes 2 --gpus-per-node 8` means. Unless the command line pins it (`--set parallel.dp=N`), dp becomes the launch's
processes divided by tp x pp, keeping the global batch (the trajectory does not depend on dp; the micro batch shrinks
when it must, which changes memory, not the steps).
"""

from __future__ import annotations

import copy

from plait.config import Config
from plait.errors import ConfigError


def pinned_dp(overrides: list[str] | None) -> bool:
    """Whether --set fixes parallel.dp to a number (not "auto")."""
    for s in overrides or []:
        key, _, value = s.partition("=")
        if key.strip() == "parallel.dp" and value.strip().strip("'\"") != "auto":
            return True
    return False


def follow_launch(cfg: Config, world: int, how: str, pinned: bool, say) -> Config:
    """cfg with parallel.dp = world / (tp x pp) when it is not pinned and differs; `say` gets one line about it."""
    p, t = cfg.parallel, cfg.train
    servers = p.ps_servers if p.sync == "ps" and p.ps_placement == "dedicated" else 0
    if pinned or world <= 0 or p.dp * p.tp * p.pp + servers == world or (world - servers) % (p.tp * p.pp):
        return cfg
    new = copy.deepcopy(cfg)
    dp = new.parallel.dp = (world - servers) // (p.tp * p.pp)
    if t.global_batch_size % dp:
        raise ConfigError(f"{how} gives {world} processes, so parallel.dp would be {dp}, which does not divide "
                          f"train.global_batch_size ({t.global_batch_size}); set train.global_batch_size to a multiple "
                          f"of {dp}, or pin the layout with --set parallel.dp=N")
    note = ""
    if t.global_batch_size % (t.micro_batch_size * dp):
        new.train.micro_batch_size = t.global_batch_size // dp
        note = f", train.micro_batch_size {t.micro_batch_size} -> {new.train.micro_batch_size} (the global batch kept)"
    if dp == 1:
        new.parallel.zero, new.parallel.offload, new.parallel.embedding_sharding = 0, "none", "none"
    say(f"parallel.dp {p.dp} -> {dp} to fill {how} ({world} processes / tp {p.tp} x pp {p.pp}){note}; pin it with "
        "--set parallel.dp=N")
    return new


__all__ = ["follow_launch", "pinned_dp"]
