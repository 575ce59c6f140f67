"""`plait fed`: argument parsing only; each sub-verb runs in plait.federated.commands, which calls one public
function of plait.federated.

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

TOKEN_ENV = "PLAIT_FED_TOKEN"
SIM_DEFAULTS = ["model.name='mlp'", "data.name='digits'"]  # what `plait fed` runs with no config


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
    s.set_defaults(fn="plait.federated.commands:cmd_simulate")

    v = verbs.add_parser("server", help="coordinate clients over HTTP (binds federated.host:federated.port)")
    _common(v)
    v.add_argument("--token-file", help=f"client tokens: lines 'TOKEN' or 'CLIENT_ID TOKEN' (default: ${TOKEN_ENV})")
    v.add_argument("--ssl-certfile", help="TLS certificate (PEM); serve HTTPS")
    v.add_argument("--ssl-keyfile", help="TLS private key (PEM)")
    v.set_defaults(fn="plait.federated.commands:cmd_server")

    c = verbs.add_parser("client", help="one data owner: train on its own partition when the server asks")
    _common(c, run_dir=False)
    c.add_argument("--server", required=True, metavar="HOST:PORT", help="the server's address (or a full URL)")
    c.add_argument("--client-id", type=int, required=True, help="this client's id, 0..federated.clients-1")
    c.add_argument("--token-file", help=f"file holding this client's token (default: ${TOKEN_ENV})")
    c.add_argument("--ca-file", help="CA certificate to verify an HTTPS server with")
    c.set_defaults(fn="plait.federated.commands:cmd_client")
