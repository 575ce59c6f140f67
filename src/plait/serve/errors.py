"""The errors of serving: a model or option that cannot be served (ServeError) and a wrong request (RequestError).

Every room of plait.serve raises them; the entrypoints turn them into HTTP answers (RequestError carries the status).
"""

from __future__ import annotations

from plait.errors import PlaitError


class ServeError(PlaitError):
    """A serving option or model cannot be served as asked (the CLI prints it and exits 2)."""


class RequestError(ServeError):
    """A client request is wrong: carries the HTTP status the server answers with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
