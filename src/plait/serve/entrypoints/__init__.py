"""The HTTP entrypoints: thin translations from a protocol to the service's and the engine's requests.

It owns the ASGI app and its Open Inference Protocol (KServe v2) routes (`app`) and their tensor codec (`protocol`),
the OpenAI-compatible routes (`openai_api`: /v1/completions, /v1/chat/completions, /v1/models onto the engine) and
running all of it on uvicorn (`server`). A new endpoint touches this package only.
"""
