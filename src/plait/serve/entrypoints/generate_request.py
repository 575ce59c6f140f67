"""A /v1/generate body as the row the service generates: plait's own generation route (the OpenAI ones are
plait.serve.entrypoints.openai_request)."""

from __future__ import annotations

import math
import secrets

from plait.data.tokenizer import CharTokenizer
from plait.serve.errors import RequestError
from plait.serve.executor.tasks import GenRow
from plait.serve.service import MIN_TEMPERATURE, SURROGATE, Service


def gen_row(service: Service, body: dict) -> tuple[GenRow, bool, int]:
    """Check a /v1/generate body; returns the row to generate, whether to stream, and the prompt's token count.

    The prompt's length is checked before anything is copied. With a character tokenizer only its last `context`
    characters are tokenized: the model sees no more than that (kvcache.generate keeps the last `context`
    tokens), so the tokens generated are the same as for the whole prompt.
    """
    allowed = {"prompt", "max_new_tokens", "temperature", "top_k", "seed", "stream", "model"}
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise RequestError(400, f"unknown field '{str(unknown[0])[:64]}'; /v1/generate takes: {', '.join(sorted(allowed))}")
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise RequestError(400, "'prompt' must be a non-empty string")
    if len(prompt) > service.opts.max_prompt_chars:
        raise RequestError(413, f"'prompt' has {len(prompt)} characters; the limit is {service.opts.max_prompt_chars} "
                                "(--max-prompt-chars)")
    if SURROGATE.search(prompt):
        raise RequestError(400, "'prompt' holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not a character")

    def integer(key: str, default, low: int, high: int):
        v = body.get(key, default)
        if v is None and default is None:
            return None
        if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= high:
            raise RequestError(400, f"'{key}' must be an integer between {low} and {high}, got {_short(v)}")
        return v

    n = integer("max_new_tokens", min(64, service.opts.max_new_tokens), 1, service.opts.max_new_tokens)
    top_k = integer("top_k", None, 1, 1 << 31)
    seed = integer("seed", None, 0, (1 << 63) - 1)
    temperature = body.get("temperature", 1.0)
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not (
            math.isfinite(temperature) and 0 <= temperature <= 100):
        raise RequestError(400, f"'temperature' must be a number between 0 and 100 (0: greedy), got {_short(temperature)}")
    if 0 < temperature < MIN_TEMPERATURE:  # logits / temperature would overflow float32
        raise RequestError(400, f"'temperature' must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {temperature!r}")
    service.require_generation()
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be true or false")
    tok = service.served.tokenizer
    assert tok is not None
    # A character is a token only for a character tokenizer: for one that joins characters (BPE), the last
    # `context` characters are fewer tokens than the model takes, cut at a place that changes the tokens.
    tail = prompt[-max(1, service.served.context):] if isinstance(tok, CharTokenizer) else prompt
    ids = [int(i) for i in tok.encode(tail)]
    row = GenRow(ids, n, float(temperature), top_k, secrets.randbits(63) if seed is None else seed)
    return row, stream, len(prompt)


def _short(v) -> str:
    """A value for an error message, never long (and never a deep structure's repr)."""
    if isinstance(v, (dict, list)):
        return f"a JSON {'object' if isinstance(v, dict) else 'array'}"
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."
