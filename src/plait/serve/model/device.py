"""`--device auto|cpu|cuda`: where the served model runs, and the few places tensors cross between it and the host.

Requests arrive and answers leave as numpy arrays in host memory; the model and everything it
computes live on the device. The crossings, and nothing else, are:

    the model            plait.serve.executor.runner.Runner (in-process and in each replica process); a pipeline
                         stage moves its own part (plait.serve.fleet.pipeline.stage_main)
    inputs  -> device    Runner.infer (the batch), kvcache.generate (token ids and padding), a stage (what it receives)
    outputs -> host      Runner.infer and the last pipeline stage (numpy for the HTTP answer)
    between stages       activations go through host memory: gloo sends CPU tensors (and NCCL cannot join two
                         processes that share one GPU, which is the usual case here)
    sampling             the last position's logits come to the host and are sampled there with each row's CPU
                         torch.Generator (kvcache.generate; a pipeline's server process samples on the host anyway):
                         a seed draws the same tokens from the same logits on every device

Loading is always on the host (safetensors, the finiteness check, --quantize); the model moves once loaded.
A process that serves on CUDA takes GPU `index mod GPUs` (replica i, stage r): several replicas or stages on
one GPU share it. --quantize (dynamic int8) runs on CPU only, so `auto` picks cpu with it and `cuda` refuses it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from plait.serve.errors import ServeError

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def serve_device(choice: str, quantize: str | None = None, cuda_available: Callable[[], bool] | None = None) -> str:
    """`--device` resolved to "cpu" or "cuda"; a ServeError naming the flag when it cannot be honoured.

    cuda_available: the CUDA check (default torch.cuda.is_available; tests pass a fake one).
    """
    if choice not in DEVICE_CHOICES:
        raise ServeError(f"--device {choice!r} is not one of: {', '.join(DEVICE_CHOICES)}")
    available = cuda_available or torch.cuda.is_available
    if choice == "cuda":
        if quantize:
            raise ServeError(f"--quantize {quantize} runs on CPU only; drop --quantize or pass --device cpu "
                             "instead of --device cuda")
        if not available():
            raise ServeError("--device cuda but CUDA is not available here; pass --device auto or --device cpu")
        return "cuda"
    if choice == "cpu" or quantize:
        return "cpu"
    return "cuda" if available() else "cpu"


def torch_device(name: str, index: int = 0) -> torch.device:
    """The torch device of serving process `index` (a replica or a pipeline stage; 0 in-process).

    cuda: GPU `index mod GPUs`, made this thread's current device (as plait.runtime.pick_device does for training).
    """
    if name == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", index % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device
