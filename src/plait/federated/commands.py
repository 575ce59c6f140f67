"""What `plait fed simulate|server|client` do (their parsers: plait.federated.cli): the config with the flags applied,
the run directory, the tokens, then one public function of plait.federated.
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
from plait.federated.cli import SIM_DEFAULTS, TOKEN_ENV
from plait.federated.client import run_client
from plait.federated.server import serve
from plait.federated.simulate import compare, simulate
from plait.federated.strategies import STRATEGIES
from plait.federated.wire import parse_tokens


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
