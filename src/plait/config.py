"""The config: TOML tables whose keys each component declares, loaded, merged with --set and checked.

Usage::

    cfg = load_config("job.toml", overrides=["parallel.dp=2", "train.steps=100"])
    print(format_config(cfg))          # what `plait config show` prints
    text = dump_config(cfg)            # the resolved TOML written to a run dir

The loader and merger only: the keys belong to the components that read them, each declaring a group
where it lives, in a module that imports no torch (plait/parallel/keys.py, plait/train/keys.py, ...)::

    @keys("parallel")
    class PipelineKeys:
        pp_schedule: str = opt("1f1b", "pipeline schedule: gpipe or 1f1b", choices=("gpipe", "1f1b"))
        microbatches: int = opt(0, "pipeline micro-batches per step", minimum=0)

        def check(self, cfg) -> None:     # its own rules, after the generic ones (choices, minimum, finite)
            ...

A section is its groups' keys, flat (`cfg.parallel.pp_schedule`); `cfg.keys(PipelineKeys)` is a group's own
view. Bad keys, types and values raise ConfigError naming the key, the rule and the fix, before any worker starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plait.errors import ConfigError

# --------------------------------------------------------------------------- declaring keys


def opt(default: Any, doc: str, choices: tuple | None = None, accepts: tuple = (), minimum: float | None = None,
        above: float | None = None, finite: bool = False, why: str = "", fix: str = "") -> Any:
    """A config key with its one-line description and the generic rules it must meet.

    choices: the allowed values; accepts: further types taken and converted to the key's type (launch.nnodes takes
    2 or "1:2"); minimum / above: value >= minimum / > above; finite: no inf or nan. why and fix complete the
    minimum's message: "KEY = V must be >= M (why); set --set KEY=fix".
    """
    meta = {"doc": doc, "choices": choices, "accepts": accepts, "minimum": minimum, "above": above,
            "finite": finite, "why": why, "fix": fix}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


_GROUPS: dict[str, list[type]] = {}  # section -> the key groups declared for it, in registration order
_SECTION_OF: dict[type, str] = {}
_TYPES: dict[str, type] = {}  # section -> its composed dataclass (rebuilt when a group registers)
_ORDER: list[str] = []  # the order of the tables in a config file (sections declared later follow it)


def order_sections(*names: str) -> None:
    """Fix the order in which sections are listed and written (plait's package does, once, for its own)."""
    _ORDER[:] = [*names, *(n for n in _ORDER if n not in names)]


def _section_names() -> list[str]:
    known = [n for n in _ORDER if n in _GROUPS]
    return known + [n for n in _GROUPS if n not in known]


def keys(section: str):
    """Class decorator: the (data)class's fields become keys of [section]; its `check(self, cfg)` runs in validation."""

    def register(cls: type) -> type:
        if not dataclasses.is_dataclass(cls):
            cls = dataclass(cls)

        def same(g: type) -> bool:  # a group registered again (its module reloaded) replaces itself
            return g.__qualname__ == cls.__qualname__ and g.__module__ == cls.__module__

        others = [g for g in _GROUPS.get(section, []) if not same(g)]
        names = {f.name for f in dataclasses.fields(cls)}
        for g in others:
            twice = names & {f.name for f in dataclasses.fields(g)}
            if twice:
                raise ValueError(f"{section}.{sorted(twice)[0]} is declared twice: by {g.__name__} and {cls.__name__}")
        for g in [g for g in _SECTION_OF if same(g)]:
            del _SECTION_OF[g]
        _GROUPS[section] = [*others, cls]
        _SECTION_OF[cls] = section
        _TYPES.pop(section, None)
        return cls

    return register


_DERIVED: dict[str, Any] = {}  # name -> fn(cfg): what a component derives from its keys, read as cfg.<name>


def derived(name: str):
    """Function decorator: cfg.<name> is fn(cfg), a figure a component derives from its keys."""

    def register(fn):
        _DERIVED[name] = fn
        return fn

    return register


def unregister(cls: type) -> None:
    """Take a group's keys out of its section again (tests that declare a toy scheme's keys)."""
    section = _SECTION_OF.pop(cls)
    _GROUPS[section] = [g for g in _GROUPS[section] if g is not cls]
    if not _GROUPS[section]:
        del _GROUPS[section]
    _TYPES.pop(section, None)


class Section:
    """The base of every composed section; the attribute fallback tells type checkers the keys are dynamic."""

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"[{type(self).__name__}] has no key {name!r}")


def section_type(section: str) -> type:
    """The dataclass of [section]: the fields of every group declared for it, in order."""
    if section not in _TYPES:
        if section not in _GROUPS:
            raise KeyError(section)
        fields = []
        for group in _GROUPS[section]:
            hints = typing.get_type_hints(group)
            for f in dataclasses.fields(group):
                copy = (field(default_factory=f.default_factory, metadata=f.metadata)
                        if f.default_factory is not dataclasses.MISSING else field(default=f.default, metadata=f.metadata))
                fields.append((f.name, hints[f.name], copy))
        name = section.capitalize() + "Config"
        _TYPES[section] = dataclasses.make_dataclass(name, fields, bases=(Section,), namespace={"__module__": __name__})
    return _TYPES[section]


class _Sections(Mapping):
    """SECTIONS: section name -> its composed dataclass, live (a group declared later shows up)."""

    def __getitem__(self, name: str) -> type:
        return section_type(name)

    def __iter__(self) -> Iterator[str]:
        return iter(_section_names())

    def __len__(self) -> int:
        return len(_GROUPS)


SECTIONS: Mapping[str, type] = _Sections()


def __getattr__(name: str) -> Any:
    # ModelConfig, ParallelConfig, ...: the composed section types, as `from plait.config import ModelConfig` expects
    if name.endswith("Config") and name[:-len("Config")].lower() in _GROUPS:
        return section_type(name[:-len("Config")].lower())
    raise AttributeError(f"module 'plait.config' has no attribute {name!r}")


class Config:
    """A whole job: one attribute per section (cfg.model, cfg.parallel, ...), each a dataclass of its keys."""

    def __init__(self, **sections: Any):
        for name in _section_names():
            setattr(self, name, sections.pop(name) if name in sections else section_type(name)())
        if sections:
            raise TypeError(f"unknown sections {sorted(sections)}")

    def __getattr__(self, name: str) -> Any:
        if name in _DERIVED:  # a figure a component derives from its keys (launch: cfg.node_range, cfg.elastic)
            return _DERIVED[name](self)
        if name in _GROUPS:  # a section declared after this config was made: its defaults
            value = section_type(name)()
            setattr(self, name, value)
            return value
        raise AttributeError(f"the config has no section [{name}]")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and config_to_dict(self) == config_to_dict(other)

    def __repr__(self) -> str:
        return f"Config({', '.join(f'{s}={getattr(self, s)!r}' for s in SECTIONS)})"

    def keys(self, group: type) -> Any:
        """A key group's own view of its keys (a copy): cfg.keys(PipelineKeys).pp_schedule."""
        section = getattr(self, _SECTION_OF[group])
        return group(**{f.name: getattr(section, f.name) for f in dataclasses.fields(group)})


def groups() -> list[tuple[str, type]]:
    """(section, group) for every declared key group, in order."""
    return [(s, g) for s in _section_names() for g in _GROUPS[s]]


# --------------------------------------------------------------------------- parsing


def _type_name(tp: Any) -> str:
    if isinstance(tp, types.UnionType):  # int | str: a number or "auto"
        return 'a whole number or "auto"' if set(tp.__args__) == {int, str} else " or ".join(map(_type_name, tp.__args__))
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list", dict: "a table"}
    return names.get(tp, str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check a TOML value against a field's type; ints are accepted where floats are expected."""
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    takes_int = tp is int or isinstance(tp, types.UnionType) and int in tp.__args__
    if not isinstance(value, tp) or (takes_int and isinstance(value, bool)):
        raise ConfigError(f"{key} = {value!r} has the wrong type: it must be {_type_name(tp)}; "
                          f"fix the value in the config or --set {key}=<{_type_name(tp)}>")
    return value


def _fields(section_type: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(section_type)}


def config_from_dict(data: dict, source: str = "config") -> Config:
    """Build a Config from a nested dict (a parsed TOML file); rejects unknown sections and keys."""
    cfg = Config()
    for section, values in data.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown section [{section}] in {source}; valid sections: {', '.join(SECTIONS)}")
        if not isinstance(values, dict):
            raise ConfigError(f"[{section}] in {source} must be a table of keys, not {values!r}")
        for key, value in values.items():
            set_value(cfg, f"{section}.{key}", value, source=source)
    return cfg


def set_value(cfg: Config, dotted: str, value: Any, source: str = "--set") -> None:
    """Set `section.key` on cfg after checking that the key exists and the type matches."""
    parts = dotted.split(".")
    if len(parts) != 2:
        raise ConfigError(f"'{dotted}' from {source} is not of the form section.key (e.g. train.steps)")
    section, key = parts
    key = KEYWORD_FIELDS.get(key, key)
    if section not in SECTIONS:
        raise ConfigError(f"unknown section '{section}' in '{dotted}' from {source}; valid sections: {', '.join(SECTIONS)}")
    fields = _fields(SECTIONS[section])
    if key not in fields:
        close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
        raise ConfigError(f"unknown key '{dotted}' in {source}; keys of [{section}]: {', '.join(map(toml_key, fields))}"
                          + (f" (did you mean {section}.{close[0]}?)" if close else ""))
    tp = typing.get_type_hints(SECTIONS[section])[key]
    if isinstance(value, fields[key].metadata.get("accepts") or ()) and not isinstance(value, bool):
        value = tp(value)
    value = _coerce(dotted, value, tp)
    setattr(getattr(cfg, section), key, value)


def parse_override(text: str) -> tuple[str, Any]:
    """Parse `section.key=value`; the value is read as a TOML literal, else taken as a plain string."""
    if "=" not in text:
        raise ConfigError(f"--set '{text}' must be of the form section.key=value (e.g. --set train.steps=100)")
    key, raw = text.split("=", 1)
    key, raw = key.strip(), raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key, value


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """Apply `--set section.key=value` overrides in order; an unquoted string key's value is taken literally (so
    `data.path=2024-01-01` stays a path rather than becoming a TOML date)."""
    for text in overrides:
        key, value = parse_override(text)
        raw = text.split("=", 1)[1].strip()
        if _field_type(key) is str and not isinstance(value, str) and raw[:1] not in ("'", '"'):
            value = raw
        set_value(cfg, key, value, source=f"--set {text}")
    return cfg


def _field_type(dotted: str):
    section, _, key = dotted.partition(".")
    if section not in SECTIONS:
        return None
    return typing.get_type_hints(SECTIONS[section]).get(KEYWORD_FIELDS.get(key, key))


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, validate: bool = True) -> Config:
    """Load a TOML config (or the built-in default job when path is None), apply overrides, resolve, validate.

    Resolving: a group with a `resolve(cfg)` static method fills in what the machine decides ("auto" values)."""
    if path is None:
        cfg = Config()
    else:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist; pass an existing .toml file or none for the default job")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p} is not valid TOML: {e}") from None
        cfg = config_from_dict(data, source=str(p))
    apply_overrides(cfg, overrides or [])
    for _, group in groups():
        if callable(getattr(group, "resolve", None)):
            group.resolve(cfg)
    if validate:
        validate_config(cfg)
    return cfg


def note_auto(cfg: Config, notes: list[str]) -> None:
    """Record what was decided for "auto" values, in words (auto_notes reads them back)."""
    cfg.__dict__["_auto_notes"] = auto_notes(cfg) + notes


def auto_notes(cfg: Config) -> list[str]:
    """What load_config decided for the "auto" values of cfg, in words (empty when there were none)."""
    return list(cfg.__dict__.get("_auto_notes", []))


# TOML keys that are Python keywords live in fields with a trailing underscore.
KEYWORD_FIELDS = {"async": "async_"}


def toml_key(field_name: str) -> str:
    return field_name[:-1] if field_name.endswith("_") else field_name


def config_to_dict(cfg: Config) -> dict:
    """The config as nested dicts with the TOML spelling of every key."""
    return {section: {toml_key(k): v for k, v in dataclasses.asdict(getattr(cfg, section)).items()} for section in SECTIONS}


def dump_config(cfg: Config) -> str:
    """The config as TOML text (every key), loadable by load_config."""
    import tomli_w  # lazily: only writing a run's config needs it

    return tomli_w.dumps(config_to_dict(cfg))


def format_config(cfg: Config) -> str:
    """Every key with its value and one-line description, as `plait config show` prints it."""
    import tomli_w  # lazily: only `plait config show` needs it

    def literal(value: Any) -> str:
        if isinstance(value, dict):
            return "{" + ", ".join(f"{k} = {literal(v)}" for k, v in value.items()) + "}"
        if isinstance(value, list):
            return "[" + ", ".join(literal(v) for v in value) + "]"
        return tomli_w.dumps({"v": value}).strip()[len("v = "):]

    lines = []
    for section, section_type in SECTIONS.items():
        obj = getattr(cfg, section)
        lines += [f"[{section}]", *(f"{toml_key(f.name) + ' = ' + literal(getattr(obj, f.name)):<36} # {f.metadata['doc']}"
                                    for f in dataclasses.fields(section_type)), ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- validation


def _check_field(dotted: str, value: Any, meta: Mapping) -> None:
    """The generic rules a key declares: its choices, a minimum, a strict lower bound, finiteness."""
    choices = meta.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{dotted} = {value!r} is not one of: {', '.join(map(str, choices))}; set one of those")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    if meta.get("finite") and not math.isfinite(value):
        raise ConfigError(f"{dotted} = {value} must be a finite number")
    low = meta.get("minimum")
    if low is not None and not value >= low:
        why = f" ({meta['why']})" if meta.get("why") else ""
        raise ConfigError(f"{dotted} = {value} must be >= {low}{why}; set --set {dotted}={meta.get('fix') or f'<value >= {low}>'}")
    if meta.get("above") is not None and not value > meta["above"]:
        raise ConfigError(f"{dotted} = {value} must be > {meta['above']}")


def validate_config(cfg: Config) -> Config:
    """Reject impossible values: every key's declared rules, then each group's own `check`. Rules that need a model or
    a scheme are theirs (plait.train.job.check_job runs them)."""
    for section, group in groups():
        obj = getattr(cfg, section)
        for f in dataclasses.fields(group):
            _check_field(f"{section}.{toml_key(f.name)}", getattr(obj, f.name), f.metadata)
    for _, group in groups():
        if callable(getattr(group, "check", None)):
            cfg.keys(group).check(cfg)
    return cfg
