"""What the HTTP transport and the round logic share, below both of them.

transport.py serves a `RoundService` and server.py's Coordinator is one; server.py starts the
transport. Neither needs the other's module for its types, so the imports run one way:
server -> transport -> wire, server -> wire. This module holds the error both raise, the task
message's framing and the bearer tokens, and imports nothing heavier than the standard library,
so the CLI can read a tokens file without importing FastAPI or torch.
"""

from __future__ import annotations

import hmac
import json
from typing import TYPE_CHECKING, Protocol

from plait.errors import PlaitError

if TYPE_CHECKING:
    from plait.config import FederatedConfig
    from plait.federated.tensors import Weights


class FederatedError(PlaitError):
    """A federated run cannot go on: no quorum of clients, a wrong token, a config that differs from the server's."""


class RoundService(Protocol):
    """What the HTTP app asks of the round logic; every method answers for one client and never raises on its input
    except `register` (ValueError: a key outside the group)."""

    fed: FederatedConfig
    length: int  # values in the model: bounds the size of an upload
    seen: dict[int, float]  # registered clients, by when they were last heard from

    def register(self, client_id: int, public_key: int | None = None) -> None: ...

    def task(self, client_id: int) -> tuple[dict, Weights | None]: ...

    def weights_blob(self) -> bytes: ...

    def submit(self, client_id: int, rnd: int, tensors: Weights, meta: dict) -> tuple[bool, str]: ...

    def submit_unmask(self, client_id: int, rnd: int, seeds: dict) -> tuple[bool, str]: ...

    def status(self) -> dict: ...


def frame(meta: dict, blob: bytes) -> bytes:
    """A task message: 8-byte length, the JSON task, then the weights blob (possibly empty)."""
    head = json.dumps(meta).encode()
    return len(head).to_bytes(8, "little") + head + blob


def unframe(body: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(body[:8], "little")
    return json.loads(body[8:8 + n]), body[8 + n:]


def parse_tokens(text: str) -> dict:
    """Tokens file: each line `TOKEN` (shared by all clients) or `CLIENT_ID TOKEN`; a line starting with '#' is a
    comment ('#' inside a token is part of it)."""
    tokens: dict = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) == 1:
            tokens["*"] = parts[0]
        elif len(parts) == 2 and parts[0].isdigit():
            tokens[int(parts[0])] = parts[1]
        else:
            raise FederatedError(f"tokens file line {n}: expected 'TOKEN' or 'CLIENT_ID TOKEN', got {line!r}")
    if not tokens:
        raise FederatedError("the tokens file holds no token; add a line with a token")
    return tokens


def authorized(tokens: dict, header: str | None, client_id: int | None) -> bool:
    if not header or not header.startswith("Bearer "):
        return False
    given = header[len("Bearer "):].encode()
    want = [tokens[client_id]] if client_id in tokens else []
    if "*" in tokens:
        want.append(tokens["*"])
    if client_id is None:
        want = list(tokens.values())
    return any(hmac.compare_digest(given, w.encode()) for w in want)
