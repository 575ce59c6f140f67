"""The engine with --quantize int8 (weight-only, torchao) and --lora adapters together (issue 55 item 6): each request's
greedy tokens equal a reference built here by hand, the int8 base's linear plus scale * B (A x) on each adapted layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from serve.test_engine import adapter_file
from serve.test_serve_openai import PROMPT  # noqa: F401

pytest.importorskip("torchao")
openai = pytest.importorskip("openai")


class Adapted(nn.Module):
    def __init__(self, base: nn.Module, a: torch.Tensor, b: torch.Tensor, scale: float):
        super().__init__()
        self.base, self.a, self.b, self.scale = base, a, b, scale

    def forward(self, x):
        return self.base(x) + self.scale * (x @ self.a.T @ self.b.T)


def reference(path, tensors, scale):
    from plait.serve.model.load import ModelRef, load_model

    model = load_model(ModelRef(str(path), quantize="int8")).module
    for key, a in tensors.items():
        if key.endswith(".lora_A"):
            name = key[:-len(".lora_A")]
            parent, _, leaf = name.rpartition(".")
            holder = model.get_submodule(parent)
            setattr(holder, leaf, Adapted(getattr(holder, leaf), a, tensors[name + ".lora_B"], scale))
    return model.eval()


def test_int8_weights_and_lora_adapters_together(hf_dir, tmp_path):  # noqa: F811
    from plait.models.hf import load_hf_model
    from plait.serve.entrypoints.server import ServerThread
    from plait.serve.service import ServeOptions

    _, _, plain, _ = load_hf_model(hf_dir["dir"])
    files = {"sql": adapter_file(plain, tmp_path / "sql.safetensors", ["blocks.0.attn.q_proj", "blocks.1.mlp.up_proj"],
                                 4, 64.0, 1),
             "chat": adapter_file(plain, tmp_path / "chat.safetensors", ["blocks.1.attn.o_proj", "head"], 2, 32.0, 2)}
    ids = hf_dir["tok"].encode(PROMPT, add_special_tokens=False).ids
    want = {}
    for name, tensors in files.items():
        with torch.no_grad():
            out = reference(hf_dir["dir"], tensors, 16.0).generate(torch.tensor([ids]), 10, temperature=0)
        want[name] = out[0, len(ids):].tolist()
    assert want["sql"] != want["chat"]
    opts = ServeOptions(name="tiny", quantize="int8", block_size=8, kv_cache_mb=4, max_delay_ms=0,
                        lora=(f"sql={tmp_path / 'sql.safetensors'}", f"chat={tmp_path / 'chat.safetensors'}"))
    with ServerThread(hf_dir["dir"], opts) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        got = {m: client.completions.create(model=m, prompt=ids, max_tokens=10, temperature=0, logprobs=0,
                                            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
               for m in ("sql", "chat")}
    for name, r in got.items():
        assert [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens] == want[name]
