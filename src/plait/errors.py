"""Errors a user can cause. The CLI prints them in one or two lines and exits 2."""

from __future__ import annotations


class PlaitError(Exception):
    """Base class for errors that a user can fix (bad config, bad file, bad request)."""


class ConfigError(PlaitError):
    """The config is invalid: unknown key, wrong type, or an impossible layout."""


class DataError(PlaitError):
    """A data source cannot be found or read."""


class CheckpointError(PlaitError):
    """A checkpoint or run directory is missing, incomplete or unreadable."""
