"""A search space file: each config key and the distribution its value is drawn from.

    # space.toml
    optim.lr = {log_uniform = [1e-4, 1e-1]}
    optim.warmup_steps = {int = [0, 50]}         # whole numbers, ends included
    model.width = {choice = [32, 64, 128]}
    optim.weight_decay = {uniform = [0.0, 0.1]}
    train.micro_batch_size = {log_int = [4, 32]}
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path

from plait.config import SECTIONS
from plait.errors import ConfigError

KINDS = ("log_uniform", "uniform", "int", "log_int", "choice")


@dataclass(frozen=True)
class Dim:
    key: str  # section.key
    kind: str
    values: tuple

    def suggest(self, trial):
        """The value an Optuna trial draws for this key."""
        if self.kind == "choice":
            return trial.suggest_categorical(self.key, list(self.values))
        lo, hi = self.values
        if self.kind in ("uniform", "log_uniform"):
            return trial.suggest_float(self.key, float(lo), float(hi), log=self.kind == "log_uniform")
        return trial.suggest_int(self.key, int(lo), int(hi), log=self.kind == "log_int")


def _flatten(d: dict, path: Path) -> dict:
    """{section: {key: spec}} (how TOML reads `section.key = spec`) -> {"section.key": spec}."""
    out = {}
    for section, table in d.items():
        if not isinstance(table, dict):
            raise ConfigError(f"--space {path}: {section} = {table!r}: write section.key = {{kind = [...]}}, "
                              f"e.g. optim.lr = {{log_uniform = [1e-4, 1e-2]}}")
        out.update({f"{section}.{k}": v for k, v in table.items()})
    return out


def read_space(path: Path) -> list[Dim]:
    """The dimensions of a space file; every key must be a config key and every range well formed."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--space {path} does not exist")
    try:
        flat = _flatten(tomllib.loads(path.read_text()), path)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--space {path}: {e}") from None
    if not flat:
        raise ConfigError(f"--space {path} names no keys; write e.g. optim.lr = {{log_uniform = [1e-4, 1e-2]}}")
    sections = dict(SECTIONS)
    dims = []
    for key, spec in flat.items():
        section, _, name = key.partition(".")
        fields = _fields(sections.get(section))
        if name not in fields:
            import difflib

            known = [f"{s}.{n}" for s in sections for n in _fields(sections[s])]
            close = difflib.get_close_matches(key, known, n=1)
            raise ConfigError(f"--space {path}: {key} is not a config key"
                              + (f"; did you mean {close[0]}?" if close else ""))
        if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
            raise ConfigError(f"--space {path}: {key} = {spec!r}: give one of {', '.join(KINDS)}, e.g. "
                              f"{key} = {{log_uniform = [1e-4, 1e-2]}} or {{choice = [32, 64]}}")
        kind, values = next(iter(spec.items()))
        if not isinstance(values, list) or not values:
            raise ConfigError(f"--space {path}: {key}: {kind} takes a list, e.g. [low, high]")
        if kind != "choice":
            if len(values) != 2 or not all(isinstance(v, (int, float)) for v in values) or values[0] > values[1]:
                raise ConfigError(f"--space {path}: {key}: {kind} takes [low, high] with low <= high, not {values}")
            if kind.startswith("log") and values[0] <= 0:
                raise ConfigError(f"--space {path}: {key}: {kind} needs low > 0 (a log scale), not {values[0]}")
            if kind in ("int", "log_int") and not all(isinstance(v, int) for v in values):
                raise ConfigError(f"--space {path}: {key}: {kind} takes whole numbers, not {values}")
        dims.append(Dim(key, kind, tuple(values)))
    return dims


def _fields(section_type) -> set[str]:
    if section_type is None:
        return set()
    return {f.name for f in dataclasses.fields(section_type)}


def as_override(key: str, value) -> str:
    """`--set` text for a drawn value (strings quoted as TOML strings)."""
    if isinstance(value, str):
        return f"{key}={value!r}"
    if isinstance(value, bool):
        return f"{key}={'true' if value else 'false'}"
    return f"{key}={value!r}"
