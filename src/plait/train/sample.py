"""The end-of-run sample: a short seeded continuation that shows what a language model learned (the console and
summary.json), generated on rank 0 from the whole trained weights, whatever the layout.

    text = generate_sample(strategy, bundle, cfg, rt)   # every rank calls it: gathering the weights is a collective

The weights go into a freshly built plain model given the run's fine-tuning layers (LoRA, QLoRA's nf4 base,
bottleneck adapters) so that their names load, LoRA then merged. A chat run (data.name = "chat") is prompted as its
data was, through the tokenizer's chat template (plait.data.chat.sample_turn), and its reply ends at the
end-of-sequence token; other runs continue train.sample_prompt. plait's models sample with their own `generate`; a
transformers model (model.hf_class, or one a model.factory returns) token by token through its forward, whose
output plait's hooks make the logits (plait.models.registry.unwrap_outputs), never with transformers' `generate`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from plait.data import DataBundle
from plait.data.chat import sample_turn
from plait.data.preference import preference_turn
from plait.finetune import merge_lora
from plait.models import build_model
from plait.models.protocols import GeneratingModel, is_transformers_model
from plait.models.sampling import sample
from plait.train.keys import SAMPLE_PROMPT
from plait.train.weights import trained_layers

TEMPERATURE, TOP_K = 0.8, 20


def generate_sample(strategy, bundle: DataBundle, cfg, rt) -> str | None:
    """A short seeded continuation of the run's prompt (language models only), generated on rank 0 (None elsewhere).

    The weights are gathered into a plain single-process model first (a collective: every rank calls this)."""
    if bundle.tokenizer is None or cfg.train.sample_tokens <= 0 or bundle.spec.task != "lm":
        return None
    weights = strategy.full_model_state_dict()
    if not rt.is_main:
        return None
    module = trained_layers(build_model(cfg.model, bundle.spec), cfg.finetune)
    if not (isinstance(module, GeneratingModel) or is_transformers_model(module)):
        return None
    module.load_state_dict(weights)
    module = merge_lora(module).to(rt.device).eval()
    tok, device = bundle.tokenizer, rt.device
    own = cfg.train.sample_prompt if cfg.train.sample_prompt != SAMPLE_PROMPT else None
    text, eos = sample_turn(cfg.data, own) or preference_turn(cfg.data, own) or (cfg.train.sample_prompt, "")
    prompt = torch.tensor(tok.encode(text).astype("int64"), device=device)[None]
    g = torch.Generator(device=device).manual_seed(cfg.train.seed)
    with torch.no_grad():
        if is_transformers_model(module):
            out = token_by_token(module, prompt, cfg.train.sample_tokens, g)
        else:
            out = module.generate(prompt, cfg.train.sample_tokens, temperature=TEMPERATURE, top_k=TOP_K, generator=g)
    ids = out[0].tolist()
    stop = tok.encode(eos).tolist() if eos else []
    if len(stop) == 1 and stop[0] in ids[prompt.shape[1]:]:  # the reply ends at the end-of-sequence token
        ids = ids[:ids.index(stop[0], prompt.shape[1])]
    return tok.decode(ids)


def token_by_token(module: nn.Module, idx: torch.Tensor, new_tokens: int, generator: torch.Generator) -> torch.Tensor:
    """`new_tokens` sampled continuations of idx (batch, time) by a model whose forward gives logits (batch, time,
    vocab), its whole window each step (no cache: a sample of a few hundred tokens at the end of a run)."""
    window = int(getattr(getattr(module, "config", None), "max_position_embeddings", 0) or 0) or None
    for _ in range(new_tokens):
        logits = module(idx[:, -window:] if window else idx)[:, -1, :]
        idx = torch.cat([idx, sample(logits, TEMPERATURE, TOP_K, generator)], dim=1)
    return idx
