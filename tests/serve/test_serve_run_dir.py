"""A run fine-tuned from a Hugging Face Llama, served as a run directory (not its export): its chat template and its
end-of-sequence token come from the checkpoint's files the run carried (RUN/hf/), so the OpenAI chat endpoint renders
the template and stops at </s> with the finish reason "stop" and no </s> in the text (issue 57 items 2, 3)."""

from __future__ import annotations

import pytest
import torch

from hf_helpers import corpus, llama_dir, sets
from plait.config import load_config
from plait.serve.entrypoints.server import ServerThread
from plait.serve.model.load import ModelRef, load_model
from plait.serve.service import ServeOptions
from plait.train.trainer import train

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("hfrun")
    src = llama_dir(root / "llama", always_eos=True)  # every next token is </s>: a reply ends at once
    run = root / "run"
    train(load_config(None, sets(f"train.init_from='{src}'", "data.name='text'", f"data.path='{corpus(root)}'",
                                 "finetune.lora_rank=4", "train.steps=2", "train.sample_tokens=0")), run)
    return {"run": run, "src": src}


def test_a_run_directory_serves_with_its_checkpoints_template_and_stop_token(lora_run):
    served = load_model(ModelRef(str(lora_run["run"])))
    eos = served.tokenizer.tokenizer.token_to_id("</s>")
    assert served.eos_ids == frozenset({eos}) and served.chat is not None
    with ServerThread(lora_run["run"], ServeOptions(name="tuned", block_size=8, kv_cache_mb=1)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        r = client.chat.completions.create(model="tuned", messages=[{"role": "user", "content": "the cat"}],
                                           max_tokens=8, temperature=0, logprobs=True)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == "" and r.usage.completion_tokens == 1
    assert len(choice.logprobs.content) == 1 and torch.isfinite(torch.tensor(choice.logprobs.content[0].logprob))
