"""`plait serve`: argument parsing only (registered in plait.cli.VERB_MODULES; `plait bench serve` is plait.bench.cli)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from plait.errors import ConfigError

TOKEN_ENV = "PLAIT_SERVE_TOKEN"


def serve_token(a) -> str | None:
    """The bearer token: --token, else --token-file (its first line that is not blank or a '#' comment line), else
    $PLAIT_SERVE_TOKEN, else none."""
    if a.token:
        print("note: --token is visible to other users of this machine (ps); prefer --token-file FILE or "
              f"${TOKEN_ENV}", file=sys.stderr)
        return a.token
    if a.token_file:
        p = Path(a.token_file)
        if not p.is_file():
            raise ConfigError(f"--token-file {a.token_file}: no such file")
        try:
            lines = [ln.strip() for ln in p.read_bytes().decode("utf-8").splitlines()]
        except UnicodeDecodeError:
            raise ConfigError(f"--token-file {a.token_file} is not UTF-8 text; write the token on a line of its own") from None
        except OSError as e:
            raise ConfigError(f"--token-file {a.token_file} cannot be read ({e.strerror})") from None
        token = next((ln for ln in lines if ln and not ln.startswith("#")), None)  # a '#' inside a token is the token's
        if token is None:
            raise ConfigError(f"--token-file {a.token_file} holds no token")
        return token
    return os.environ.get(TOKEN_ENV) or None


def exposure_warning(host: str, token: str | None) -> str | None:
    """What to say when the server listens beyond loopback with no token (anyone who reaches the port is served)."""
    import ipaddress

    if token:
        return None
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve beyond loopback
        loopback = False
    if loopback:
        return None
    return (f"warning: --host {host} listens beyond this machine with no token: anyone who reaches the port can use "
            f"the model; pass --token-file FILE (or ${TOKEN_ENV}) and put TLS in front (docs/security.md)")


class DefaultsFormatter(argparse.HelpFormatter):
    """--help that ends each option's line with its default, unless the text says it already or there is none."""

    def _get_help_string(self, action):
        text, value = action.help or "", action.default
        if not action.option_strings or "default" in text or value is None or value is False or value == argparse.SUPPRESS:
            return text
        shown = ",".join(map(str, value)) if isinstance(value, list) else f"{value:g}" if isinstance(value, float) else value
        return f"{text} (default: {str(shown).replace('%', '%%')})"


def add_parsers(sub, bench) -> None:
    """Add `plait serve` to the top-level verbs."""
    s = sub.add_parser("serve", help="serve a run or an exported model over HTTP (Open Inference Protocol)",
                       formatter_class=DefaultsFormatter,
                       description="Serve RUN_DIR (its latest checkpoint), or a model.safetensors, model.onnx or "
                                   "model.pt2 from `plait export`.")
    s.add_argument("model", type=Path, nargs="?", metavar="RUN_DIR|model.safetensors|model.onnx|model.pt2",
                   help="what to serve: a run directory, its export, an edge file or a Hugging Face directory")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    s.add_argument("--name", "--served-model-name", dest="name",
                   help="model name in URLs and the OpenAI API's `model` (default: the registry name, e.g. mlp, gpt or "
                        "llama; the OpenAI API also answers to the path as given)")
    s.add_argument("--replicas", type=int, default=1, help="worker processes each holding the model (1: in-process)")
    s.add_argument("--route", choices=["prefix", "least-loaded", "round-robin"], default="prefix",
                   help="--replicas of a language model: which replica's engine takes a sequence (prefix: the one "
                        "whose KV cache holds the longest prefix of its prompt; cold prompts to the least loaded)")
    s.add_argument("--pp", "--pipeline-parallel-size", dest="pp", type=int, default=1,
                   help="pipeline stages: the model's blocks split over K processes; a language model runs the engine "
                        "(the server is stage 0, each stage keeps the KV cache of its own blocks), other models and "
                        "--scheduler static run static batches")
    s.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                   help="language models: tensor-parallel generation over N processes, each with 1/N of the weights "
                        "and of the KV cache")
    s.add_argument("--autoscale", metavar="MIN:MAX", help="replica processes follow the load between MIN and MAX; "
                                                          "MIN 0: none while idle, requests held while one starts")
    s.add_argument("--target-ongoing", type=float, default=2.0, help="--autoscale: ongoing requests per replica aimed at")
    s.add_argument("--upscale-delay-s", type=float, default=1.0, help="--autoscale: more replicas wanted this long first")
    s.add_argument("--downscale-delay-s", type=float, default=10.0, help="--autoscale: fewer wanted this long first")
    s.add_argument("--scale-to-zero-after-s", type=float, default=30.0,
                   help="--autoscale with MIN 0: no request for this long stops the last replica")
    s.add_argument("--max-batch-size", type=int, default=16, help="rows merged into one batch at most (1: no batching)")
    s.add_argument("--max-delay-ms", type=float, default=5.0, help="longest wait for a batch to fill")
    s.add_argument("--max-queue", type=int, default=256, help="queued requests before answering 503 (backpressure)")
    s.add_argument("--timeout-ms", type=float, default=30_000.0, help="a request not answered by then gets 504")
    s.add_argument("--token", "--api-key", dest="token",
                   help="require 'Authorization: Bearer TOKEN' (health probes stay open); visible in ps, so prefer "
                        f"--token-file or ${TOKEN_ENV}")
    s.add_argument("--token-file", help=f"file whose first line is the bearer token (default: ${TOKEN_ENV}, if set)")
    s.add_argument("--quantize", choices=["int8"], help="int8 weights for the linear layers (torchao weight-only, as "
                   "`plait compress --quantize int8`; CPU)")
    s.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where the model runs: auto (cuda when available; cpu with --quantize), cpu or cuda; replicas "
                        "and pipeline stages take GPU i mod the GPUs there are (several on one GPU share it)")
    s.add_argument("--scheduler", choices=["continuous", "static"], default="continuous",
                   help="language models: continuous batching over a paged KV cache (in one process), or static "
                        "batches generated together until the longest ends (also what --autoscale does)")
    _add_engine_args(s)
    s.add_argument("--max-body-mb", type=float, default=16.0, help="larger request bodies get 413")
    s.add_argument("--max-new-tokens", type=int, default=1024, help="the most tokens one generate request may ask for")
    s.add_argument("--max-prompt-chars", type=int, default=65_536, help="longer /v1/generate prompts get 413")
    s.add_argument("--read-timeout-s", type=float, default=10.0,
                   help="a request head, and then its whole body, must each arrive within this (else the connection "
                        "closes; 408 for a body)")
    s.add_argument("--max-connections", type=int, default=256,
                   help="open connections at most; 8 more answer one health probe or /metrics each, more are closed at once")
    s.add_argument("--trust-factory", action="store_true",
                   help="build a model.factory named in an exported file: imports and runs that code (see docs/security.md)")
    s.add_argument("--trust-checkpoint", action="store_true",
                   help="serve a run checkpoint that has no manifest.json (plait 0.1), or a .pt2 that torch would run "
                        "code from (pickled payloads, an AOTInductor library); see docs/security.md")
    s.add_argument("--threads", type=int, default=0, help="torch threads per model process (0: for the LLM engine in-process "
                   "OMP_NUM_THREADS if set, else every core; cores - 1 for other models in-process; cores / N for N "
                   "replicas or stages)")
    s.add_argument("--no-exact-batching", action="store_true",
                   help="let a batched answer differ from the lone one in the last bit: no strict BLAS mode "
                        "(MKL_CBWR=AUTO,STRICT on Intel), no padding rows (plait.serve.executor.runner)")
    _add_vllm_args(s)
    s.set_defaults(fn="plait.serve.commands:cmd_serve")


# vLLM's flags that have no plait twin: (flag, what plait takes instead). The twins are aliases above
# (--served-model-name, --tensor-parallel-size, --pipeline-parallel-size, --api-key, --max-num-seqs,
# --max-num-batched-tokens).
VLLM_REFUSED = {
    "--gpu-memory-utilization": "plait sizes the KV cache in megabytes: --kv-cache-mb MB",
    "--swap-space": "plait preempts by recomputing, it does not swap: leave it out",
    "--quantization": "plait quantizes weights itself: --quantize int8",
    "--speculative-config": "plait's speculative decoding takes a draft model: --draft DIR --num-speculative-tokens K",
    "--trust-remote-code": "plait never imports a model directory's code; it builds Llama-family and GPT-2 models "
                           "itself",
}


def _add_vllm_args(s) -> None:
    """vLLM's `serve` / api_server flags a vLLM user types: mapped onto plait's, or refused naming plait's."""
    g = s.add_argument_group("vLLM's flags", "accepted as vLLM takes them (docs/serving.md, plait for vLLM users)")
    g.add_argument("--model", dest="model_flag", type=Path, metavar="DIR", help="the model to serve (vLLM's "
                                                                                "api_server form of the positional)")
    g.add_argument("--max-model-len", type=int, default=0, help="the most tokens (prompt and output) of one sequence "
                                                                "(0: the model's context)")
    g.add_argument("--dtype", choices=["auto", "float32", "float", "bfloat16", "half", "float16"], default="auto",
                   help="the weights' type: plait serves float32 (auto); others are refused")
    g.add_argument("--enable-prefix-caching", dest="no_prefix_caching", action="store_false", default=False,
                   help="share the KV-cache blocks of a prompt prefix (plait's default)")
    g.add_argument("--no-enable-prefix-caching", dest="no_prefix_caching", action="store_true",
                   help="--no-prefix-caching")
    g.add_argument("--enable-lora", action="store_true", help="accepted: --lora NAME=PATH enables LoRA")
    g.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH", help="--lora NAME=PATH, each")
    for flag in VLLM_REFUSED:
        g.add_argument(flag, dest="refused_" + flag[2:].replace("-", "_"), nargs="?", const=True,
                       help=f"refused: {VLLM_REFUSED[flag]}")


def vllm_flags(a) -> Path:
    """Fold vLLM's flags into plait's (in `a`); the model path. ConfigError naming plait's flag for a refused one."""
    for flag, instead in VLLM_REFUSED.items():
        if getattr(a, "refused_" + flag[2:].replace("-", "_"), None) is not None:
            raise ConfigError(f"{flag} is vLLM's and plait has no such setting; {instead}")
    if a.dtype not in ("auto", "float32", "float"):
        raise ConfigError(f"--dtype {a.dtype}: plait serve runs float32 weights; leave --dtype out (or auto), or use "
                          "--quantize int8 for smaller ones")
    if a.max_model_len < 0:
        raise ConfigError(f"--max-model-len {a.max_model_len} must be >= 0 (0: the model's context)")
    a.lora = list(a.lora or []) + list(a.lora_modules or [])
    if a.model is not None and a.model_flag is not None and a.model != a.model_flag:
        raise ConfigError(f"two models given: {a.model} and --model {a.model_flag}; give one")
    model = a.model if a.model is not None else a.model_flag
    if model is None:
        raise ConfigError("give the model to serve: plait serve RUN_DIR|model.safetensors|HF_DIR (or --model DIR)")
    return model


def _add_engine_args(s) -> None:
    """The continuous-batching engine's flags of `plait serve`."""
    s.add_argument("--block-size", type=int, default=16, help="continuous: tokens per KV-cache block")
    s.add_argument("--kv-cache-mb", type=float, default=64.0,
                   help="continuous: the KV-cache block pool, all layers (each process's, of its own layers or heads, "
                        "under --pp and --tp)")
    s.add_argument("--max-seqs", "--max-num-seqs", dest="max_seqs", type=int, default=128,
                   help="continuous: sequences in one engine step at most")
    s.add_argument("--max-step-tokens", "--max-num-batched-tokens", dest="max_step_tokens", type=int, default=0,
                   help="continuous, decode first: the tokens of one engine step at most, every decode first and prompt "
                        "chunks in what is left, so long prompts do not stretch the decodes' steps (0: no such bound)")
    s.add_argument("--max-prefill-tokens", dest="max_prefill_tokens", type=int, default=2048,
                   help="continuous: prompt tokens in one engine step at most; longer prompts go in chunks")
    s.add_argument("--no-prefix-caching", action="store_true",
                   help="continuous: do not share the KV-cache blocks of a prompt prefix seen before")
    s.add_argument("--draft", type=Path, metavar="RUN_OR_DIR",
                   help="continuous: speculative decoding with this smaller model of the same tokenizer as the draft")
    s.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="--draft: tokens the draft proposes per step, checked by the served model in one forward")
    s.add_argument("--lora", action="append", metavar="NAME=PATH",
                   help="continuous: a LoRA adapter (a LoRA run or an --adapters-only export) over the served model, "
                        "answering requests whose model is NAME; repeat for more (they share batches)")
