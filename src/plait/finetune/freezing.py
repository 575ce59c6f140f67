"""Freezing parameters by glob patterns over the plain model's names.

    names = freeze(model, ["tok_emb*", "blocks.0.*"])   # requires_grad = False on those; returns their names

A frozen parameter has no gradient, so it gets no optimizer state (plait.train.optim builds its groups
from the parameters that require one), no gradient traffic (DDP buckets, ZeRO's flat buffers and FSDP's
reduce-scatter take only parameters that require a gradient) and no gradient memory. A pattern that
matches nothing is a ConfigError naming the closest names, so a typo never freezes less than intended.
"""

from __future__ import annotations

import difflib
import fnmatch

import torch.nn as nn

from plait.errors import ConfigError


def closest(pattern: str, names: list[str], n: int = 3) -> list[str]:
    """The names nearest to a pattern (its literal part), for error messages."""
    literal = pattern.replace("*", "").replace("?", "")
    found = difflib.get_close_matches(literal, names, n=n, cutoff=0.3)
    return found or names[:n]


def match(patterns: list[str], names: list[str], key: str, what: str = "parameter") -> list[str]:
    """Names matching any pattern; a pattern matching none raises ConfigError (key: the config key, for the message).

    A pattern without a dot also matches the names that end in it ('q_proj' is '*.q_proj', as peft's target_modules).
    """
    out: set[str] = set()
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"{key}: {pattern!r} is not a glob pattern; give strings such as 'blocks.0.*'")
        hits = fnmatch.filter(names, pattern)
        if "." not in pattern:
            hits += fnmatch.filter(names, "*." + pattern)
        if not hits:
            near = ", ".join(closest(pattern, names))
            raise ConfigError(f"{key}: pattern {pattern!r} matches no {what} name; the closest are: {near}; "
                              "patterns are globs over the plain model's names (e.g. 'blocks.0.*')")
        out.update(hits)
    return [n for n in names if n in out]


def freeze(model: nn.Module, patterns: list[str], key: str = "finetune.freeze") -> list[str]:
    """Set requires_grad = False on the parameters whose names match; returns the names frozen."""
    params = dict(model.named_parameters(remove_duplicate=False))
    names = match(patterns, list(params), key)
    for name in names:
        params[name].requires_grad_(False)
    return names


def trainable_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
