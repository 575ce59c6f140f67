"""plait's llama keeps the single process's trajectory at every layout, with plain SGD (tests/parallel/test_equivalence.py
says why SGD): per-step loss and gradient norm within 1e-5 relative, final weights within 1e-5.

The llama here has grouped-query attention (4 query heads over 2 kv heads, which tensor parallel splits as groups),
an untied head, and a vocabulary of the corpus's 159 characters padded to 192 rows (model.vocab_multiple = 64):
tensor parallel splits the padded rows, and the padding is never in the loss. The Mixtral-style variant (top-2 of
4 SwiGLU experts) is checked at expert parallel.
"""

from __future__ import annotations

import pytest

from helpers import TINY_GPT
from plait.config import load_config

STEPS = 4
SGD = ("optim.name='sgd'", "optim.lr=0.3", "optim.momentum=0", "optim.weight_decay=0", "optim.grad_clip=0",
       "optim.schedule='constant'", "optim.warmup_steps=0", "log.every=1", f"train.steps={STEPS}", "checkpoint.every=0")
LLAMA = ("model.name='llama'", "data.name='text'", "model.vocab_size=0", "model.layers=2", "model.heads=4",
         "model.kv_heads=2", "model.hidden=48", "model.tie_embeddings=false", "model.rope_theta=500.0",
         "train.global_batch_size=8", "train.micro_batch_size=2")
MIXTRAL = ("model.moe_experts=4", "model.moe_top_k=2", "model.moe_aux_weight=0.01", "model.layers=2")
RTOL = ATOL = 1e-5

TWO = {
    "dp2": ("parallel.dp=2",),
    "dp2-zero3-ckpt": ("parallel.dp=2", "parallel.zero=3", "train.activation_checkpointing=true"),
    "tp2": ("parallel.dp=1", "parallel.tp=2"),
    "tp2-sp": ("parallel.dp=1", "parallel.tp=2", "parallel.sequence_parallel=true"),
    "pp2-1f1b": ("parallel.dp=1", "parallel.pp=2", "parallel.pp_schedule='1f1b'"),
}
FOUR = {"dp2xtp2": ("parallel.dp=2", "parallel.tp=2")}


@pytest.fixture(scope="module")
def eq():
    """test_equivalence's trajectory helpers (imported here, not at the top, so its tests are not collected twice)."""
    import importlib

    return importlib.import_module("test_equivalence")


@pytest.fixture(scope="module")
def base(tiny_text):
    return (*TINY_GPT, *LLAMA, f"data.path='{tiny_text}'", *SGD)


@pytest.fixture(scope="module")
def reference(base, eq, tmp_path_factory):
    cache: dict = {}

    def get(*more: str):
        if more not in cache:
            cache[more] = eq.trajectory(load_config(None, [*base, "parallel.dp=1", *more]),
                                        tmp_path_factory.mktemp("ref") / "run")
        return cache[more]

    return get


def test_the_llama_reference_learns_and_a_2x_gradient_error_shows(reference, eq):
    ref = reference()
    assert ref.loss[-1] < ref.loss[0] - 0.3, ref.loss
    e = eq.errors(ref, reference("optim.lr=0.15"))
    assert e["loss"] > 100 * RTOL and e["grad_norm"] > 100 * RTOL and e["weights"] > 100 * ATOL, e


@pytest.mark.parametrize("name", list(TWO))
def test_llama_two_rank_layouts(pool2, reference, base, eq, tmp_path, name):
    got = pool2.run(eq.trajectory, load_config(None, [*base, *TWO[name]]), tmp_path)[0]
    eq.assert_same_trajectory(reference(), got)


@pytest.mark.parametrize("name", list(FOUR))
def test_llama_four_rank_layouts(pool4, reference, base, eq, tmp_path, name):
    got = pool4.run(eq.trajectory, load_config(None, [*base, *FOUR[name]]), tmp_path)[0]
    eq.assert_same_trajectory(reference(), got)


def test_mixtral_at_expert_parallel(pool2, reference, base, eq, tmp_path):
    got = pool2.run(eq.trajectory, load_config(None, [*base, *MIXTRAL, "parallel.dp=2", "parallel.ep=2"]), tmp_path)[0]
    eq.assert_same_trajectory(reference(*MIXTRAL), got)


HF_FACTORY = ("model.factory='user_models:hf_llama'", "model.name='gpt'")


def test_a_transformers_model_trains_by_its_no_split_modules_and_its_tp_and_pp_plans(pool2, base, eq, tmp_path_factory):
    """transformers' LlamaForCausalLM through model.factory: its ModelOutput unwrapped to .logits, its ZeRO-3 and
    activation-checkpointing units its LlamaDecoderLayers, its tensor- and pipeline-parallel plans its own; dp2 +
    ZeRO-3, tp2 and pp2 keep the one-process trajectory."""
    import user_models
    from plait.models.protocols import megatron_plan
    from plait.parallel.base import model_blocks

    model = user_models.hf_llama(layers=3)
    assert [type(b).__name__ for b in model_blocks(model)] == ["LlamaDecoderLayer"] * 3
    plan = megatron_plan(model)
    assert {n.rsplit(".", 1)[-1] for n in plan if n.startswith("model.layers.0.")} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    ref = eq.trajectory(load_config(None, [*base, *HF_FACTORY, "parallel.dp=1"]), tmp_path_factory.mktemp("hf") / "r")
    assert ref.loss[-1] < ref.loss[0] - 0.3, ref.loss
    got = pool2.run(eq.trajectory, load_config(None, [*base, *HF_FACTORY, "parallel.dp=2", "parallel.zero=3",
                                                      "train.activation_checkpointing=true"]), tmp_path_factory.mktemp("z3"))[0]
    eq.assert_same_trajectory(ref, got)
    # tp2 by the model's own declared plan (LlamaForCausalLM._tp_plan: q/k/v, gate/up column-parallel, o/down
    # row-parallel, a vocabulary-parallel embedding, the head's logits gathered)
    from plait.models.hf_plans import hf_tp_plan

    styles = {n: type(s).__name__ for n, s in hf_tp_plan(model).items()}
    assert styles["lm_head"] == styles["model.layers.2.mlp.gate_proj"] == "ColwiseParallel"
    assert styles["model.embed_tokens"] == styles["model.layers.0.self_attn.o_proj"] == "RowwiseParallel"
    assert len(styles) == 2 + 7 * 3
    got = pool2.run(eq.trajectory, load_config(None, [*base, *HF_FACTORY, "parallel.dp=1", "parallel.tp=2"]),
                    tmp_path_factory.mktemp("tp2"))[0]
    eq.assert_same_trajectory(ref, got)
    # pp2 by its declared _pp_plan: embed_tokens first, the decoder layers cut, norm and lm_head last; a later stage
    # takes the hidden states as inputs_embeds, so the model's own forward (rotary embedding, mask) runs on each.
    # Tied here: the embedding on the first stage and the head on the last are one weight, their gradients summed.
    from plait.models.protocols import pipeline_parts, tied_parameters

    assert pipeline_parts(model) == {"blocks": "model.layers", "first": ["model.embed_tokens"],
                                     "last": ["lm_head", "model.norm"], "embeds_input": True}
    tied = ("model.options={tied=true}",)
    assert tied_parameters(user_models.hf_llama(tied=True)) == {"lm_head.weight": "model.embed_tokens.weight"}
    ref = eq.trajectory(load_config(None, [*base, *HF_FACTORY, *tied, "parallel.dp=1"]), tmp_path_factory.mktemp("t1"))
    got = pool2.run(eq.trajectory, load_config(None, [*base, *HF_FACTORY, *tied, "parallel.dp=1", "parallel.pp=2",
                                                      "parallel.pp_schedule='1f1b'"]), tmp_path_factory.mktemp("pp2"))[0]
    eq.assert_same_trajectory(ref, got)


def test_a_transformers_model_that_cannot_split_is_refused_before_launch(tiny_text):
    from plait.errors import ConfigError
    from plait.train.job import check_job

    def refusal(*more):
        with pytest.raises(ConfigError) as e:
            check_job(load_config(None, [*TINY_GPT, *HF_FACTORY, "data.name='text'", f"data.path='{tiny_text}'",
                                         "parallel.dp=1", *more]))
        return str(e.value)

    assert refusal("parallel.tp=4") == ("parallel.tp = 4 splits LlamaForCausalLM's attention by heads, but its "
                                        "num_key_value_heads = 2 is not divisible by 4; set parallel.tp to a divisor of 2")
    assert refusal("parallel.tp=2", "model.options={vocab=161}").startswith(
        "parallel.tp = 2 splits model.embed_tokens by rows (its vocabulary of 161), which is not divisible by 2")
    assert refusal("parallel.tp=2", "parallel.sequence_parallel=true") == (
        "LlamaForCausalLM's tensor-parallel plan does not shard activations along the sequence; set "
        "parallel.sequence_parallel=false")


@pytest.fixture(scope="module")
def chat(tiny_text, tmp_path_factory):
    """data.name = 'chat', packed: pairs of consecutive source lines as prompt and completion (varied lengths, some
    longer than the context, so rows hold several examples and some are cut)."""
    import json

    lines = [ln.strip() for ln in (tiny_text / "textwrap.py").read_text().splitlines() if ln.strip()][:160]
    path = tmp_path_factory.mktemp("chat") / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": a + "\n", "completion": b}) + "\n"
                            for a, b in zip(lines[::2], lines[1::2], strict=False)))
    return ("data.name='chat'", f"data.path='{path}'", "data.pack=true")


CHAT = {**TWO, "cp2-zero3": ("parallel.dp=1", "parallel.cp=2", "parallel.zero=3")}


@pytest.mark.parametrize("name", ["dp2-zero3-ckpt", "tp2", "cp2-zero3"])
def test_packed_chat_keeps_the_trajectory(pool2, reference, base, eq, tmp_path, chat, name):
    """The loss on completions only (a mean of row means) and attention confined to each packed example: the same
    per-step loss, gradient norm and weights at dp2 ZeRO-3, tp2 and cp2 ZeRO-3 as in one process (under cp a row's
    trained tokens fall unevenly on the two ranks: each divides by the whole row's count)."""
    ref = reference(*chat)
    assert ref.loss[-1] < ref.loss[0], ref.loss
    got = pool2.run(eq.trajectory, load_config(None, [*base, *CHAT[name], *chat]), tmp_path)[0]
    eq.assert_same_trajectory(ref, got)


LORA = ("finetune.lora_rank=4", "finetune.lora_alpha=8", "finetune.lora_targets=['q_proj', 'v_proj', 'down_proj']")


@pytest.mark.parametrize("method", [(), ("finetune.quantize_base='nf4'",), ("finetune.freeze=['blocks.0.*', 'tok_emb.*']",)],
                         ids=["lora", "qlora", "freeze"])
def test_fine_tuning_methods_keep_the_trajectory_at_zero3(pool2, reference, base, eq, tmp_path, method):
    """LoRA by the Llama names (a pattern without a dot matches the names ending in it), QLoRA (the nf4 base and the
    adapters sharded) and freezing, at dp2 + ZeRO-3, on one process's trajectory."""
    lora = not (method and method[0].startswith("finetune.freeze"))
    # 4 blocks here (2 elsewhere in this file): over 2, the adapters' 4 steps do not lower the loss
    ft = ("model.layers=4", *((*LORA, *method) if lora else method))
    ref = reference(*ft)
    assert ref.loss[-1] < ref.loss[0], ref.loss
    got = pool2.run(eq.trajectory, load_config(None, [*base, *TWO["dp2-zero3-ckpt"], *ft]), tmp_path)[0]
    eq.assert_same_trajectory(ref, got)
    if lora:  # the adapters sit on the Llama-named layers (3 per block, 4 blocks)
        assert len({k.rsplit(".", 1)[0] for k in got.params if ".lora_" in k}) == 3 * 4, sorted(got.params)

