"""plait's Python API: what the command line does, from Python (docs/api.md).

    import plait

    cfg = plait.Config.load().override("model.name=mlp", "data.name=digits", "train.steps=20")
    result = plait.train(cfg, out="runs/x")            # starts the workers itself, as `plait train` does
    plait.export("runs/x", "model.safetensors")
    with plait.serve("model.safetensors") as server:   # server.url, server.stop()
        ...
    model = plait.load("runs/x")                       # the trained nn.Module (a run dir or an exported file)

Your own model, dataset, loss and metrics go in as importable names ("package.module:function") or as the
functions themselves when they are defined at module level in a module: the workers are separate
processes that import them by name, so a lambda, a function defined inside another, or one defined in the
script being run (__main__) is refused with the reason. Errors a user can fix are PlaitError subclasses
(ConfigError before any worker starts), as on the command line.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plait.config import Config as _Config
from plait.config import apply_overrides, dump_config, format_config, load_config, validate_config
from plait.errors import CheckpointError, ConfigError, PlaitError
from plait.launch.resume import absolute_paths
from plait.launch.start import launch_checked, start_run
from plait.refs import import_object
from plait.rundir import is_federated_run, new_run_dir
from plait.train.job import check_job

if TYPE_CHECKING:  # `plait.Config` must not import torch
    import torch.nn as nn

__all__ = ["Config", "Result", "Server", "TrainingFailed", "export", "load", "reference", "run_train", "serve", "train"]

Ref = str | Callable


class TrainingFailed(PlaitError):
    """The workers exited with an error (their messages are on stderr and in RUN_DIR/logs)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class Config:
    """A training job's config: `plait config show` lists every key. Sections read as attributes (cfg.train.steps).

    Configs are values: `override` returns a new one and leaves this one as it is.
    """

    def __init__(self, cfg: _Config | None = None):
        self._cfg = cfg if cfg is not None else _Config()

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
        """A TOML file's config (None: the built-in default job), with `section.key=value` overrides applied."""
        return cls(load_config(path, list(overrides)))

    def override(self, *items: str) -> Config:
        """A new config with `section.key=value` overrides applied (values read as TOML literals, as --set does)."""
        for item in items:
            if "=" not in item:
                raise ConfigError(f"override {item!r}: expected 'section.key=value', e.g. 'train.steps=100'")
        cfg = copy.deepcopy(self._cfg)
        apply_overrides(cfg, list(items))
        validate_config(cfg)
        return Config(cfg)

    def validate(self) -> Config:
        """Check the whole job as `plait train` does before it launches (model, data, layout); raises ConfigError."""
        check_job(self._cfg)
        return self

    @property
    def raw(self) -> _Config:
        """The typed config underneath (plait.config.Config)."""
        return self._cfg

    def to_toml(self) -> str:
        """The config as TOML (every key), loadable with Config.load."""
        return dump_config(self._cfg)

    def __getattr__(self, name: str) -> Any:
        if name == "_cfg":
            raise AttributeError(name)
        return getattr(self._cfg, name)

    def __str__(self) -> str:
        return format_config(self._cfg)

    def __repr__(self) -> str:
        return f"plait.Config(model={self._cfg.model.factory or self._cfg.model.name!r}, " \
               f"data={self._cfg.data.factory or self._cfg.data.name!r}, steps={self._cfg.train.steps})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and other._cfg == self._cfg


@dataclass
class Result:
    """A finished run: its directory, summary.json and metrics.jsonl."""

    run_dir: Path
    summary: dict = field(default_factory=dict)
    metrics: list[dict] = field(default_factory=list)  # metrics.jsonl: one record per logged step (and evaluation)

    @property
    def final_loss(self) -> float | None:
        """The training loss at the last step."""
        return self.summary.get("final_loss")

    @property
    def val_loss(self) -> float | None:
        """The validation loss at the end (the data's task loss, or train.loss)."""
        return self.summary.get("val_loss")

    @property
    def losses(self) -> list[float]:
        """The training loss at every logged step, in order."""
        return [m["loss"] for m in self.metrics if "loss" in m]

    @classmethod
    def from_run_dir(cls, run_dir: str | Path) -> Result:
        run_dir = Path(run_dir)
        summary_file, metrics_file = run_dir / "summary.json", run_dir / "metrics.jsonl"
        summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
        metrics = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()] \
            if metrics_file.is_file() else []
        return cls(run_dir, summary, metrics)


def reference(key: str, obj: Ref) -> str:
    """'package.module:name' for a function or class defined at module level (a string is returned as it is).

    The workers are separate processes: they import what the config names. A lambda, a function defined
    inside another, one defined in the script being run (__main__) or an object cannot be imported there.
    """
    if isinstance(obj, str):
        return obj
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not callable(obj) or not isinstance(module, str) or not isinstance(qualname, str):
        raise ConfigError(f"{key}: got {type(obj).__name__} object; pass the function (or class) that makes it, defined "
                          "at module level, or its name 'package.module:function': each worker process builds its own")
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise ConfigError(f"{key}: {qualname} is a lambda or a function defined inside another function; the workers are "
                          "separate processes that import it by name: define it at module level in a module")
    if module == "__main__":
        raise ConfigError(f"{key}: {qualname} is defined in the script being run (__main__); the workers are separate "
                          "processes that import it by name: move it into a module (e.g. mycode.py) and import it")
    ref = f"{module}:{qualname}"
    if import_object(key, ref) is not obj:
        raise ConfigError(f"{key}: {ref} does not import back as the object given (is it decorated or replaced?); "
                          "pass 'package.module:function' naming the one to call")
    return ref


def _as_config(config: Config | str | Path | None) -> _Config:
    if isinstance(config, Config):
        return copy.deepcopy(config.raw)
    if isinstance(config, _Config):
        return copy.deepcopy(config)
    return load_config(config)


def _import_roots(refs: list[str]) -> list[str]:
    """The sys.path entries the named modules were found under (the workers need them on their PYTHONPATH)."""
    roots = []
    for ref in refs:
        module = ref.partition(":")[0]
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.origin or not Path(spec.origin).is_file():
            continue
        root = Path(spec.origin).resolve().parent
        for _ in range(module.count(".") + (1 if Path(spec.origin).name == "__init__.py" else 0)):
            root = root.parent
        roots.append(str(root))
    return roots


@contextlib.contextmanager
def _worker_env(refs: list[str]) -> Iterator[None]:
    """The workers' environment: PYTHONPATH led by where the user's modules were found in this process.

    The launcher also sets its defaults (OMP_NUM_THREADS, GLOO_SOCKET_IFNAME) there; the caller's environment
    is as it was afterwards.
    """
    before = dict(os.environ)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    add = [r for r in dict.fromkeys(_import_roots(refs)) if r not in parts]
    if add:
        os.environ["PYTHONPATH"] = os.pathsep.join(add + parts)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


def run_train(config: str | Path | None = None, overrides: Sequence[str] = (), *, out: str | Path | None = None,
              resume: str | Path | None = None, dry_run: bool = False, trust_checkpoint: bool = False) -> int:
    """`plait train` as a function: a new run (CONFIG, --set, --out) or a resumed one (--resume, --out to fork); the
    job checked once, its run directory written, its workers started (or this process one of them). Exit code."""
    return start_run(config, list(overrides), out=out, resume=resume, dry_run=dry_run,
                     trust_checkpoint=trust_checkpoint)


def train(config: Config | str | Path | None = None, *, model: Ref | None = None, dataset: Ref | None = None,
          loss: Ref | None = None, eval_metrics: Sequence[Ref] | None = None, out: str | Path | None = None) -> Result:
    """Train as `plait train` does: check the job, start its worker processes, wait for them; the finished run.

    config: a Config, a TOML file, or None for the default job. model / dataset / loss / eval_metrics set
    model.factory, data.factory, train.loss and train.eval_metrics (names or module-level functions, see
    `reference`). out: the run directory (default runs/<time>). Raises ConfigError before any worker starts,
    TrainingFailed when the workers fail.
    """
    cfg = _as_config(config)
    if model is not None:
        cfg.model.factory = reference("model", model)
    if dataset is not None:
        cfg.data.factory = reference("dataset", dataset)
    if loss is not None:
        cfg.train.loss = reference("loss", loss)
    if eval_metrics is not None:
        if isinstance(eval_metrics, (str, bytes)) or callable(eval_metrics):
            eval_metrics = [eval_metrics]
        cfg.train.eval_metrics = [reference("eval_metrics", m) for m in eval_metrics]
    absolute_paths(cfg)
    refs = [r for r in (cfg.model.factory, cfg.data.factory, cfg.train.loss, *cfg.train.eval_metrics) if r]
    run_dir = new_run_dir(out, "out =")
    with _worker_env(refs):
        code = launch_checked(cfg, run_dir)
    if code != 0:
        raise TrainingFailed(f"training {run_dir} failed (exit code {code}); the workers' errors are above and in "
                             f"{run_dir / 'logs'}", code)
    return Result.from_run_dir(run_dir)


def export(run_dir: str | Path, out: str | Path | None = None, *, format: str = "safetensors", best: bool = False,
           trust_checkpoint: bool = False, adapters_only: bool = False, batch: str | int | None = None,
           quantize: str | None = None, aoti: bool = False) -> Path:
    """Write a run's weights as `plait export` does; returns the file (or folder) written. The one front door of
    every export: the CLI calls it.

    out: a .safetensors file (default RUN_DIR/model.safetensors), a folder, or an edge export (.onnx, .pt2, .pte,
    checked against the eager model; batch, quantize and aoti apply to those). format="hf": a Hugging Face model
    directory at `out` (config.json, model.safetensors, the checkpoint's tokenizer and generation files; LoRA merged).
    best: the checkpoint checkpoint.keep_best kept.
    """
    run_dir = Path(run_dir)
    target = Path(out) if out is not None else None
    if format not in ("safetensors", "hf"):
        raise ConfigError(f"format={format!r}: plait exports 'safetensors' (with edge suffixes .onnx, .pt2, .pte) or "
                          "'hf' (a Hugging Face directory)")
    if format == "hf":
        return _export_hf(run_dir, target, best, trust_checkpoint, adapters_only or bool(batch or quantize or aoti))
    if target is not None and target.suffix in (".onnx", ".pt2", ".pte"):
        from plait.edge import check_request, export_edge  # lazily: ONNX and ExecuTorch are optional extras

        check_request(target, None if batch is None else str(batch), quantize, aoti)
        export_edge(run_dir, target, batch=None if batch is None else str(batch), quantize=quantize, aoti=aoti,
                    trust_checkpoint=trust_checkpoint)
        return target
    if batch is not None or quantize or aoti:
        raise ConfigError("batch, quantize and aoti apply to edge exports: pass out='model.onnx' or out='model.pt2'")
    if target is not None and target.is_dir():
        target = target / "model.safetensors"
    if target is not None and target.suffix != ".safetensors":
        raise ConfigError(f"out={str(target)!r}: plait writes .safetensors (weights) or an edge export (.onnx, .pt2, "
                          ".pte); name the file with one of these suffixes")
    if is_federated_run(run_dir):  # its global model is already exported, in the same format
        import shutil

        src = run_dir / "model.safetensors"
        if not src.is_file():
            raise CheckpointError(f"{run_dir} is a federated run without model.safetensors: it has not finished")
        if target is not None and target.resolve() != src.resolve():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, target)
            return target
        return src
    from plait.export import export as export_weights  # lazily: `import plait` and plait.Config must not import torch

    checkpoint = None
    if best:
        link = run_dir / "checkpoints" / "best"
        if not link.is_symlink():
            raise ConfigError(f"{run_dir} has no best checkpoint; train with --set checkpoint.keep_best='val_loss'")
        checkpoint = link.resolve()
    return export_weights(run_dir, target, checkpoint=checkpoint, trust_checkpoint=trust_checkpoint,
                          adapters_only=adapters_only)


def _export_hf(run_dir: Path, out: Path | None, best: bool, trust_checkpoint: bool, other_options: bool) -> Path:
    if out is None:
        raise ConfigError("format 'hf' writes a Hugging Face model directory: name it (-o DIR, or out=DIR)")
    if other_options:
        raise ConfigError("format 'hf' writes the whole model (adapters merged); drop --batch, --quantize, --aoti and "
                          "--adapters-only")
    from plait.export import export_hf  # lazily: `import plait` and plait.Config must not import torch

    best_link = run_dir / "checkpoints" / "best"
    if best and not best_link.exists():
        raise ConfigError(f"{run_dir} has no best checkpoint; train with --set checkpoint.keep_best='val_loss'")
    return Path(export_hf(run_dir, out, best_link if best else None, trust_checkpoint=trust_checkpoint))


def load(path: str | Path, *, trust_factory: bool = False, trust_checkpoint: bool = False) -> nn.Module:
    """The trained model, in eval mode: a run directory (its latest checkpoint, LoRA merged) or an exported .safetensors.

    An exported file that names a model.factory is code: it is built only with trust_factory=True.
    """
    p = Path(path)
    if p.is_dir():
        from plait.export import load_run_checkpoint  # lazily: `import plait` and plait.Config must not import torch
        from plait.finetune.lora import merge_lora  # lazily: `import plait` and plait.Config must not import torch

        model = merge_lora(load_run_checkpoint(p, trust_checkpoint=trust_checkpoint)[2])
    elif p.is_file() and p.suffix == ".safetensors":
        from plait.export import load_exported  # lazily: `import plait` and plait.Config must not import torch

        model = load_exported(p, trust_factory=trust_factory)[0]
    else:
        raise ConfigError(f"{p}: pass a run directory or an exported .safetensors file"
                          + ("" if p.exists() else " (it does not exist)"))
    return model.eval()


class Server:
    """A model served over HTTP in a background thread of this process (the Open Inference Protocol, as `plait serve`)."""

    def __init__(self, thread: Any):
        self._thread = thread
        self.url: str = thread.url

    def stop(self) -> None:
        """Stop answering and close the port (waits for requests in flight)."""
        if self._thread is not None:
            thread, self._thread = self._thread, None
            thread.stop()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"plait.Server({self.url}{'' if self._thread else ', stopped'})"


def serve(path: str | Path, *, host: str = "127.0.0.1", port: int = 0, **options: Any) -> Server:
    """Serve a run directory or an exported model until `.stop()`; port 0 picks a free one (see `.url`).

    options: plait.serve.service.ServeOptions' fields, the flags of `plait serve` (max_batch_size, replicas, ...).
    """
    from plait.serve.entrypoints.server import ServerThread, bind  # lazily: FastAPI and uvicorn
    from plait.serve.service import ServeOptions  # lazily: `import plait` and plait.Config must not import torch

    try:
        opts = ServeOptions(host=host, port=port, **options).validate()
    except TypeError as e:
        raise ConfigError(f"plait.serve: {e}; the options are ServeOptions' fields (the flags of plait serve)") from None
    thread = ServerThread(str(path), opts)
    if port:  # ServerThread binds a free port; the caller asked for this one
        thread.sock.close()
        thread.sock = bind(host, port)
        thread.port = port
        thread.url = f"http://{host}:{port}"
    return Server(thread.start())
