"""The LLM engine: requests in, tokens out; no HTTP, no processes of its own but --tp's ranks and --pp's stages.

It owns continuous batching (`core`: the driver, each step schedule -> forward -> sample), the scheduler policy as
a pure function of its state (`scheduler`: sequences, the KV block pool, preemption, prefix sharing), the paged KV
cache and its attention (`paged`), per-request LoRA adapters (`adapters`), speculative decoding's acceptance rule
(`speculative`), tensor-parallel ranks (`tp`), pipeline stages (`pp`) and the engine built from `plait serve`'s
options (`build`). A new scheduling policy touches `scheduler`; a new sampling option touches `core`'s sampling. An import-linter
contract keeps HTTP, the service and the fleet out of this package.
"""
