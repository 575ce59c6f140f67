"""What `plait serve` does (its parser: plait.serve.cli): fold vLLM's flags, read the token, build the options and
run the server. Imported when the verb runs."""

from __future__ import annotations

import sys

from plait.serve.cli import exposure_warning, serve_token, vllm_flags
from plait.serve.entrypoints.server import run
from plait.serve.executor.runner import strict_blas
from plait.serve.service import ServeOptions


def cmd_serve(a) -> int:
    strict_blas(exact=not a.no_exact_batching)  # before the first matrix product: MKL's path (runner.strict_blas)
    model = vllm_flags(a)
    token = serve_token(a)
    warning = exposure_warning(a.host, token)
    if warning:
        print(warning, file=sys.stderr)
    opts = ServeOptions(name=a.name, host=a.host, port=a.port, replicas=a.replicas, pp=a.pp,
                        max_batch_size=a.max_batch_size, max_delay_ms=a.max_delay_ms, max_queue=a.max_queue,
                        timeout_ms=a.timeout_ms, token=token, quantize=a.quantize, max_body_mb=a.max_body_mb,
                        max_new_tokens=a.max_new_tokens, exact_batching=not a.no_exact_batching, threads=a.threads,
                        max_prompt_chars=a.max_prompt_chars, read_timeout_s=a.read_timeout_s,
                        max_connections=a.max_connections, trust_factory=a.trust_factory,
                        trust_checkpoint=a.trust_checkpoint, device=a.device, autoscale=a.autoscale,
                        target_ongoing=a.target_ongoing, upscale_delay_s=a.upscale_delay_s,
                        downscale_delay_s=a.downscale_delay_s, scale_to_zero_after_s=a.scale_to_zero_after_s,
                        scheduler=a.scheduler, block_size=a.block_size, kv_cache_mb=a.kv_cache_mb, max_seqs=a.max_seqs,
                        max_prefill_tokens=a.max_prefill_tokens, max_step_tokens=a.max_step_tokens,
                        prefix_caching=not a.no_prefix_caching,
                        draft=None if a.draft is None else str(a.draft), num_speculative_tokens=a.num_speculative_tokens,
                        lora=tuple(a.lora or ()), tp=a.tp, route=a.route, max_model_len=a.max_model_len)
    return run(str(model), opts.validate())
