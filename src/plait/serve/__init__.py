"""Serving: `plait serve` answers the Open Inference Protocol (KServe v2) and the OpenAI API.

The rooms, top to bottom (an import-linter contract keeps each importing only those below it):
`entrypoints` (HTTP routes), `service` (one served model: options, batcher, timeouts, which executor), `fleet`
(replicas, autoscaling, pipeline stages), `executor` (the task seam and batch runners), `engine` (the LLM engine:
scheduler, paged KV cache, adapters, speculative decoding, tp), `model` (loading, device, quantization) and
`errors`. `cli` parses `plait serve`'s flags.
"""

import sys  # noqa: E402

from plait import CallableModule  # noqa: E402

sys.modules[__name__].__class__ = CallableModule  # plait.serve(...) calls the API's serve (docs/api.md)
