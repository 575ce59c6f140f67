"""Command line: argument parsing only; each verb names the function that runs it.

    plait train [CONFIG] [--set section.key=value ...] [--out DIR] [--resume RUN_DIR] [--dry-run]
    plait config show [CONFIG] [--set ...]
    plait export RUN_DIR [-o FILE] [--trust-checkpoint] [--batch dynamic|N] [--quantize int8] [--aoti]
    plait report RUN_DIR
    plait bench WHAT ...

Each verb's parser sets `fn` to "package.module:function" (plait.refs), imported only when that verb runs: the
parsers of every verb are built for each command, so they import no torch (`plait --help` stays light), and a verb
pays only for its own imports. Errors a user can fix print as one or two lines and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from plait.config import format_config, load_config
from plait.errors import ConfigError, PlaitError
from plait.exiting import exit_now
from plait.extras import missing_extra, torchvision_warning
from plait.refs import resolve


def _check_sets(sets: list[str]) -> None:
    """`--set train.steps 20` would read 20 as the config file: name the slip before anything else does."""
    for item in sets:
        if "=" not in item:
            raise ConfigError(f"--set {item}: expected SECTION.KEY=VALUE, e.g. --set {item}=... (with '=', no space)")


def cmd_config_show(a) -> int:
    config = a.config
    if config and Path(config).is_dir() and (Path(config) / "config.toml").is_file():
        config = Path(config) / "config.toml"  # a run directory: the config it ran with
    print(format_config(load_config(config, a.set)))
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("plait")
    except PackageNotFoundError:
        return "unknown (not installed)"


class _Defaults(argparse.HelpFormatter):
    """Every option's help ends with its default, unless it says it already."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        if (action.option_strings and action.default not in (None, False, [], argparse.SUPPRESS)
                and "default" not in text.lower() and "%(default)" not in text):
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    """plait's parsers (sub-commands inherit the class): the defaults formatter."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Defaults)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="plait", description="Distributed training and serving for PyTorch.")
    p.add_argument("--version", action="version", version=f"plait {_version()}")
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    t = sub.add_parser("train", help="train a model (no CONFIG: the built-in default job)")
    t.add_argument("config", nargs="?", help="TOML config file")
    t.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    t.add_argument("--out", help="run directory (default: runs/<timestamp>)")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its latest checkpoint, in place (with "
                   "--out NEW: fork it, continuing in NEW)")
    t.add_argument("--dry-run", action="store_true", help="validate and write the run's config.toml, start nothing")
    t.add_argument("--trust-checkpoint", action="store_true",
                   help="with --resume: accept checkpoints that have no manifest.json (plait 0.1); see docs/security.md")
    t.set_defaults(fn="plait.launch.start:cmd_train")

    c = sub.add_parser("config", help="inspect configs")
    csub = c.add_subparsers(dest="config_verb", required=True, metavar="ACTION")
    cs = csub.add_parser("show", help="print every key with its value and description")
    cs.add_argument("config", nargs="?", help="TOML config file (default: the built-in default job)")
    cs.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    cs.set_defaults(fn=cmd_config_show)

    e = sub.add_parser("export", help="write the run's weights as one model.safetensors")
    e.add_argument("run_dir", type=Path, help="a run directory (plait train --out)")
    e.add_argument("-o", "--output", type=Path, help="output file (default: RUN_DIR/model.safetensors); .onnx or .pt2: "
                                                      "an edge export with its parity gate (docs/serving.md)")
    e.add_argument("--trust-checkpoint", action="store_true",
                   help="accept a checkpoint that has no manifest.json (plait 0.1); see docs/security.md")
    e.add_argument("--batch", metavar="dynamic|N", help="edge exports: any number of rows (default: dynamic) or a fixed batch of N")
    e.add_argument("--quantize", dest="edge_quantize", choices=["int8"],
                   help="-o model.onnx: onnxruntime's dynamic int8 quantization (accuracy and size reported)")
    e.add_argument("--aoti", action="store_true", help="-o model.pt2: also compile with AOTInductor (needs a C++ compiler)")
    e.add_argument("--best", action="store_true",
                   help="the checkpoint checkpoint.keep_best kept (checkpoints/best) instead of the latest")
    e.add_argument("--format", choices=["safetensors", "hf"], default="safetensors",
                   help="hf: a Hugging Face model directory (config.json, safetensors shards, tokenizer) that "
                        "transformers' from_pretrained loads")
    e.add_argument("--adapters-only", action="store_true",
                   help="a LoRA run: write its adapters alone (default: merged into the weights they adapt)")
    e.set_defaults(fn="plait.commands.export:cmd_export")

    r = sub.add_parser("report", help="where a run's time went, with a verdict; (re)writes RUN_DIR/report.html")
    r.add_argument("run_dir", type=Path, help="a run directory (plait train --out)")
    r.set_defaults(fn="plait.commands.report:cmd_report")

    b = sub.add_parser("bench", help="measure plait on this machine")
    bench = b.add_subparsers(dest="bench_verb", required=True, metavar="WHAT")
    bm = bench.add_parser("memory", help="ZeRO stages 0-3: memory per rank against the ZeRO paper, step time, traffic")
    bm.add_argument("config", nargs="?", help="TOML config file (default: the built-in default job)")
    bm.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    bm.add_argument("--steps", type=int, default=6, help="steps per stage")
    bm.add_argument("--out", type=Path, help="where the runs, memory.json and memory.png go (default: runs/bench-memory-<time>)")
    bm.set_defaults(fn="plait.commands.bench_memory:cmd_bench_memory")
    for name in VERB_MODULES:
        _load_verbs(name).add_parsers(sub, bench)
    return p


# Subsystems that add their own verbs: each module has add_parsers(sub, bench), where `sub` takes
# top-level verbs and `bench` takes `plait bench <what>` verbs; each verb sets `fn`, a "module:function" (or the
# function itself, for a parser module whose verbs cost nothing to import).
VERB_MODULES: tuple[str, ...] = ("plait.serve.cli", "plait.bench.cli", "plait.federated.cli", "plait.comm.cli", "plait.plan.cli",
                                  "plait.launch.cli", "plait.audit.cli", "plait.compress.cli",
                                  "plait.report.cli", "plait.cluster.cli", "plait.tune.cli")


def _load_verbs(name: str):
    import importlib

    return importlib.import_module(name)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv:  # `plait` alone: what it can do, not an error
        parser.print_help()
        return 0
    a = parser.parse_args(argv)
    warning = torchvision_warning()
    if warning:
        print(warning, file=sys.stderr)
    try:
        _check_sets(getattr(a, "set", None) or [])
        return resolve(a.fn)(a)
    except PlaitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # an extra's module: one line naming the extra, for every verb
        line = missing_extra(e)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def run() -> None:
    """The `plait` script: main(), then the process ends without tearing its modules down (plait.exiting)."""
    exit_now(main())


if __name__ == "__main__":
    run()
