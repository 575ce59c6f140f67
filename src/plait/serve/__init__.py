"""Serving: `plait serve` answers the Open Inference Protocol (KServe v2) with dynamic batching, replica
processes or pipeline stages, and text generation for GPT runs. See plait.serve.app for the endpoints."""

import sys  # noqa: E402

from plait import CallableModule  # noqa: E402

sys.modules[__name__].__class__ = CallableModule  # plait.serve(...) calls the API's serve (docs/api.md)
