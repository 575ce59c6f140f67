"""`plait fed`: argument parsing only; each sub-verb calls one public function of plait.federated.

    plait fed simulate [CONFIG] [--clients N] [--rounds R] [--strategy S] [--compare fedavg,fedsgd,fedprox]
                       [--set section.key=value ...] [--out DIR]
    plait fed server [CONFIG] [--set ...] [--out DIR] [--token-file FILE] [--ssl-certfile F --ssl-keyfile F]
    plait fed client [CONFIG] --server HOST:PORT --client-id I [--token-file FILE] [--ca-file F] [--set ...]

With no CONFIG these run FedAvg with an MLP on `digits` (model.name = 'mlp', data.name =
'digits' are set before --set applies; the config's own defaults are a GPT on text, which
plait fed cannot partition by label). Tokens: the server takes `--token-file` (lines `TOKEN`
or `CLIENT_ID TOKEN`) or $PLAIT_FED_TOKEN, else it makes one and writes it to RUN_DIR/token;
a client takes `--token-file` (its first token) or $PLAIT_FED_TOKEN.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
import time
from pathlib import Path

from plait.config import load_config
from plait.errors import ConfigError
from plait.federated.wire import parse_tokens

TOKEN_ENV = "PLAIT_FED_TOKEN"
SIM_DEFAULTS = ["model.name='mlp'", "data.name='digits'"]  # what `plait fed` runs with no config


def _config(a):
    extra = []
    if getattr(a, "clients", None) is not None:
        extra.append(f"federated.clients={a.clients}")
    if getattr(a, "rounds", None) is not None:
        extra.append(f"federated.rounds={a.rounds}")
    if getattr(a, "strategy", None):
        extra.append(f"federated.strategy='{a.strategy}'")
    base = [] if a.config else list(SIM_DEFAULTS)
    return load_config(a.config, base + a.set + extra)


def _run_dir(a) -> Path:
    if a.out:
        return Path(a.out)
    base = Path("runs") / time.strftime("fed-%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def write_private(path: Path, text: str) -> Path:
    """Write `text` to a new file readable by its owner only (0600) and rename it over `path`: whatever was there
    before (a world-readable file, a symbolic link) is replaced, never written through or left with its mode."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mkstemp creates it with mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def _read_token_file(path: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--token-file {path}: no such file")
    try:
        return p.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"--token-file {path} is not UTF-8 text; write the token on a line of its own") from None


def cmd_simulate(a) -> int:
    from plait.federated.simulate import compare, simulate  # lazily: plait --help must not import torch
    from plait.federated.strategies import STRATEGIES  # lazily: plait --help must not import torch

    cfg = _config(a)
    out = _run_dir(a)
    if a.compare:
        names = [s.strip() for s in a.compare.split(",") if s.strip()]
        unknown = [n for n in names if n not in STRATEGIES]
        if unknown or not names:
            raise ConfigError(f"--compare {a.compare!r}: strategies must be among {', '.join(STRATEGIES)}")
        compare(cfg, out, names)
    else:
        simulate(cfg, out)
    print(f"wrote {out / 'report.html'}")
    return 0


def cmd_server(a) -> int:
    from plait.federated.server import serve  # lazily: plait --help must not import torch or FastAPI

    cfg = _config(a)
    out = _run_dir(a)
    if bool(a.ssl_certfile) != bool(a.ssl_keyfile):
        raise ConfigError("TLS needs both --ssl-certfile and --ssl-keyfile")
    if a.token_file:
        tokens = parse_tokens(_read_token_file(a.token_file))
    elif os.environ.get(TOKEN_ENV):
        tokens = {"*": os.environ[TOKEN_ENV]}
    else:
        out.mkdir(parents=True, exist_ok=True)
        token = secrets.token_urlsafe(24)
        path = write_private(out / "token", token + "\n")
        tokens = {"*": token}
        print(f"no --token-file or ${TOKEN_ENV}: clients must use the token in {path}")
    summary = serve(cfg, out, tokens, a.ssl_certfile, a.ssl_keyfile)
    print(f"done: {summary['rounds']} rounds, test accuracy {100 * summary['test_accuracy']:.1f} %; "
          f"wrote {out}")
    return 0


def cmd_client(a) -> int:
    from plait.federated.client import run_client  # lazily: plait --help must not import torch

    cfg = _config(a)
    if a.token_file:
        # a line starting with '#' is a comment; a '#' inside a token is the token's (as the server reads it)
        lines = [ln.split() for ln in _read_token_file(a.token_file).splitlines() if not ln.strip().startswith("#")]
        lines = [ln for ln in lines if ln]
        if not lines:
            raise ConfigError(f"--token-file {a.token_file} holds no token")
        token = lines[0][-1]
    elif os.environ.get(TOKEN_ENV):
        token = os.environ[TOKEN_ENV]
    else:
        raise ConfigError(f"a client needs the server's token: pass --token-file FILE or set ${TOKEN_ENV}")
    return run_client(cfg, a.server, a.client_id, token, a.ca_file)


def _common(p, run_dir: bool = True) -> None:
    p.add_argument("config", nargs="?", help="TOML config file (default: FedAvg, MLP on digits)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key")
    if run_dir:
        p.add_argument("--out", help="run directory (default: runs/fed-<timestamp>)")


def add_parsers(sub, bench) -> None:
    """Add `plait fed server|client|simulate` (the VERB_MODULES hook of plait.cli)."""
    fed = sub.add_parser("fed", help="federated learning: clients train one model without sharing their data")
    verbs = fed.add_subparsers(dest="fed_verb", required=True, metavar="ACTION")

    s = verbs.add_parser("simulate", help="run many clients in this process (experiments)")
    _common(s)
    s.add_argument("--clients", type=int, help="number of clients (federated.clients)")
    s.add_argument("--rounds", type=int, help="rounds (federated.rounds)")
    s.add_argument("--strategy", help="fedavg, fedprox, fedadam or fedsgd (federated.strategy)")
    s.add_argument("--compare", metavar="S1,S2,...", help="run each strategy on the same data and seed; one report")
    s.set_defaults(fn=cmd_simulate)

    v = verbs.add_parser("server", help="coordinate clients over HTTP (binds federated.host:federated.port)")
    _common(v)
    v.add_argument("--token-file", help=f"client tokens: lines 'TOKEN' or 'CLIENT_ID TOKEN' (default: ${TOKEN_ENV})")
    v.add_argument("--ssl-certfile", help="TLS certificate (PEM); serve HTTPS")
    v.add_argument("--ssl-keyfile", help="TLS private key (PEM)")
    v.set_defaults(fn=cmd_server)

    c = verbs.add_parser("client", help="one data owner: train on its own partition when the server asks")
    _common(c, run_dir=False)
    c.add_argument("--server", required=True, metavar="HOST:PORT", help="the server's address (or a full URL)")
    c.add_argument("--client-id", type=int, required=True, help="this client's id, 0..federated.clients-1")
    c.add_argument("--token-file", help=f"file holding this client's token (default: ${TOKEN_ENV})")
    c.add_argument("--ca-file", help="CA certificate to verify an HTTPS server with")
    c.set_defaults(fn=cmd_client)
