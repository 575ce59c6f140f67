"""Names of implementations, imported when they are first called: how a declaration points at heavy code.

    fn = resolve("plait.plan.commands:cmd_plan")     # imports plait.plan.commands now, returns its cmd_plan
    check = later("plait.launch.slurm:parse_time")   # a callable; the module is imported on its first call

A verb's parser (plait.cli and each subsystem's cli.py) and a parallel scheme's declaration
(plait.parallel.schemes) are read before anything runs: `plait --help`, the job check. They name the
code that runs the verb or the scheme as "package.module:name" instead of importing it, so reading them
imports no torch; the name is resolved by the one function that calls it (the CLI's dispatcher, a
scheme's hook). A user's own names (model.factory, data.factory) are imported by import_object, which
names the key when the name does not import.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from plait.errors import ConfigError

Ref = str | Callable  # "package.module:name", or the callable itself


def resolve(ref: Ref) -> Callable:
    """The callable `ref` names ("package.module:name", name may be dotted); a callable is returned as it is."""
    if callable(ref):
        return ref
    module, sep, attr = ref.partition(":")
    if not sep:
        raise ValueError(f"{ref!r} is not 'package.module:name'")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def later(ref: str) -> Callable:
    """A callable that resolves `ref` on its first call and passes its arguments on (an argparse type, a hook)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        return resolve(ref)(*args, **kwargs)

    call.__name__ = call.__qualname__ = ref.rpartition(":")[2]  # argparse names a failed type by it
    return call


def import_object(key: str, ref: str) -> Any:
    """Import a user's 'package.module:name' (name may be dotted: 'mod:Class.method'); ConfigError naming `key`."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key} = {ref!r} must be 'package.module:name', e.g. 'mydata:make'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{key} = {ref!r}: cannot import module {module_name!r} ({e}); put it on PYTHONPATH or in the "
                          "working directory") from None
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    if not callable(obj):
        raise ConfigError(f"{key} = {ref!r}: module {module_name} has no callable {attr!r}")
    return obj


__all__ = ["Ref", "import_object", "later", "resolve"]
