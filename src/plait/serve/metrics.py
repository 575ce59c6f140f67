"""Prometheus metrics and the structured access log of one server.

Each server owns its own CollectorRegistry, so several servers in one process (tests, the
benchmark) never share counters.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from types import ModuleType

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

orjson: ModuleType | None  # None when orjson is not installed
try:
    import orjson
except ImportError:
    orjson = None

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("plait_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "code"], registry=r)
        self.latency = Histogram("plait_request_latency_seconds", "time from request to response, by endpoint",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("plait_batch_size", "rows per batch handed to the model", buckets=BATCH_BUCKETS,
                                    registry=r)
        self.queue_depth = Gauge("plait_queue_depth", "requests waiting for a batch", registry=r)
        self.replica_restarts = Counter("plait_replica_restarts", "replica processes restarted after a crash",
                                        registry=r)
        self.replicas = Gauge("plait_replicas", "replica processes up and taking work", registry=r)
        self.replicas_desired = Gauge("plait_replicas_desired", "replicas the autoscaler wants (running or starting)",
                                      registry=r)
        self.cold_starts = Counter("plait_cold_starts", "replica processes started (at start-up, by the autoscaler, "
                                   "or after a crash)", registry=r)
        self.cold_start = Gauge("plait_cold_start_seconds", "the last replica cold start, by phase (process start, "
                                "imports, weight load) and in total", ["phase"], registry=r)
        self.rejected = Counter("plait_rejected", "requests refused by backpressure (503) or past their timeout (504)",
                                ["reason"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def access_logger() -> logging.Logger:
    """JSON lines on stderr, one per request (logger `plait.serve.access`)."""
    log = logging.getLogger("plait.serve.access")
    if not log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


def access_record(method: str, path: str, status: int, started: float, client: str | None, size: int) -> str:
    record = {"ts": round(time.time(), 3), "method": method, "path": path, "status": status,
              "latency_ms": round((time.perf_counter() - started) * 1000, 3), "client": client, "bytes": size}
    if orjson is not None:
        try:
            return orjson.dumps(record).decode()
        except orjson.JSONEncodeError:  # a path with a lone surrogate: the standard library escapes it
            pass
    return json.dumps(record, separators=(",", ":"))
