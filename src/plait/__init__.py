"""plait: distributed training and serving for PyTorch.

    import plait
    cfg = plait.Config.load().override("model.name=mlp", "data.name=digits", "train.steps=20")
    result = plait.train(cfg, out="runs/x")    # Config, train, export, serve, load: docs/api.md

The API (plait.api) is imported on first use: `import plait` imports no torch. plait.train, plait.serve
and plait.export are also plait's subpackages of those names: the package objects are callable and call
the API's function (plait.train(cfg) trains; plait.train.trainer is still the module).
"""

import importlib
import types
from typing import Any

from plait import quiet as _quiet

_quiet.install()  # known-harmless third-party lines off the consoles (plait.quiet; PLAIT_VERBOSE=1 shows them)

__version__ = "0.1.0"
__all__ = ["Config", "Result", "Server", "TrainingFailed", "export", "load", "parallelize", "serve", "train"]

_API = ("Config", "Result", "Server", "TrainingFailed", "load")
_VERBS = ("train", "serve", "export")  # API functions that share their name with a subpackage


class CallableModule(types.ModuleType):
    """A plait subpackage named like an API verb (plait.train, plait.serve, plait.export): calling it calls the verb."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module("plait.api"), self.__name__.rpartition(".")[2])(*args, **kwargs)


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module("plait.api"), name)
    if name in _VERBS:
        return importlib.import_module(f"plait.{name}")
    if name == "parallelize":  # your own loop on plait's layouts (plait.userloop, docs/models.md)
        return importlib.import_module("plait.userloop").parallelize
    raise AttributeError(f"module 'plait' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


from plait import config as _config  # noqa: E402

# The config's sections, in the order a config file lists them, and the torch-free modules that declare their keys
# (each component declares its own: plait.config only loads and merges them).
_config.order_sections("model", "data", "train", "optim", "parallel", "precision", "checkpoint", "launch", "log",
                       "federated", "finetune", "distill")
from plait.models import keys as _model_keys  # noqa: E402, F401, I001
from plait.data import keys as _data_keys  # noqa: E402, F401, I001
from plait.train import keys as _train_keys  # noqa: E402, F401, I001
from plait.parallel import keys as _parallel_keys  # noqa: E402, F401, I001
from plait.launch import keys as _launch_keys  # noqa: E402, F401, I001
from plait.federated import keys as _federated_keys  # noqa: E402, F401, I001
from plait.finetune import keys as _finetune_keys  # noqa: E402, F401, I001
from plait.plan import keys as _plan_keys  # noqa: E402, F401, I001
