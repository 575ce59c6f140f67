"""train.init_from with parallel.shard_init at ZeRO-3, tp and pp: the model is built on the meta device and each rank
reads only its own slices of a Hugging Face checkpoint (safetensors' get_slice), once the scheme has cut the model.

The trajectory is the one process's that loads the whole checkpoint (plain SGD: per-step loss, gradient norm and final
weights within 1e-5), and each rank's peak resident memory while loading is its share of the checkpoint plus a fixed
overhead: S/N + 2 x (the largest tensor)/N (a slice in flight: its file pages and its copy) + 16 MiB.
"""

from __future__ import annotations

import pytest
import torch

from helpers import TINY_GPT
from plait.config import load_config

transformers = pytest.importorskip("transformers")

# vocab 170: padded to 192 rows (model.vocab_multiple = 64), so a rank's slice of the head can lie past the checkpoint
SMALL = dict(vocab_size=170, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, rope_theta=500.0)
BIG = dict(vocab_size=4000, hidden_size=384, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=6,
           num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)  # 11.7 M parameters, 45 MiB
SGD = ("optim.name='sgd'", "optim.lr=0.3", "optim.momentum=0", "optim.weight_decay=0", "optim.grad_clip=0",
       "optim.schedule='constant'", "optim.warmup_steps=0", "log.every=1", "train.steps=4", "checkpoint.every=0")
LAYOUTS = {
    "dp2-zero3": ("parallel.dp=2", "parallel.zero=3"),
    "tp2": ("parallel.dp=1", "parallel.tp=2"),
    "pp2": ("parallel.dp=1", "parallel.pp=2"),
}
OVERHEAD = 16 * 2**20


def llama_dir(d, std: float, **kw):
    config = transformers.LlamaConfig(bos_token_id=None, eos_token_id=None, pad_token_id=None, **kw)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():  # every weight drawn, norms included: no mapping error hides behind ones
            p.normal_(1.0 if p.dim() == 1 else 0.0, std)
    model.save_pretrained(d)
    return d


def config(checkpoint, corpus, *more):
    own = [o for o in TINY_GPT if not o.startswith(("model.layers", "model.width", "model.heads"))]
    return load_config(None, [*own, "data.name='text'", f"data.path='{corpus}'", f"train.init_from='{checkpoint}'",
                              "train.global_batch_size=8", "train.micro_batch_size=2", *SGD, *more])


def traced_trajectory(cfg, run_dir):
    """Pool task: the trajectory (rank 0), and on every rank what filled the meta parameters ('parts': the checkpoint
    read in slices; 'record': a replayed initialisation) with the figures of each fill."""
    import test_equivalence
    import torch.distributed as dist

    import plait.models.meta as meta

    fills, plain = [], meta.materialize

    def traced(module, source, device):
        out = plain(module, source, device)
        fills.append(("record" if isinstance(source, meta.InitRecord) else "parts", out))
        return out

    meta.materialize = traced
    try:
        got = test_equivalence.trajectory(cfg, run_dir)
    finally:
        meta.materialize = plain
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, fills)
    return got, every


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return llama_dir(tmp_path_factory.mktemp("llama") / "small", 0.1, **SMALL)


@pytest.fixture(scope="module")
def reference(small, tiny_text, tmp_path_factory):
    import test_equivalence

    return test_equivalence.trajectory(config(small, tiny_text, "parallel.dp=1"), tmp_path_factory.mktemp("ref") / "r")


def test_the_whole_load_learns_from_the_checkpoint(reference, small):
    from safetensors.torch import load_file

    want = load_file(str(small / "model.safetensors"))
    assert reference.loss[-1] < reference.loss[0], reference.loss
    # four steps of SGD moved the weights, but from the checkpoint's: the first layer's norm started at ~1
    assert (reference.params["blocks.0.attn_norm.weight"] - want["model.layers.0.input_layernorm.weight"]).abs().max() < 0.5


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_rank_reads_its_slices_on_the_whole_loads_trajectory(pool2, reference, small, tiny_text, tmp_path, name):
    import test_equivalence

    runs = pool2.run(traced_trajectory, config(small, tiny_text, *LAYOUTS[name]), tmp_path)
    got, fills = runs[0]
    test_equivalence.assert_same_trajectory(reference, got)
    for rank, rank_fills in enumerate(fills):
        assert rank_fills and {kind for kind, _ in rank_fills} == {"parts"}, (rank, rank_fills)
        local = sum(f["local_bytes"] for _, f in rank_fills)
        assert local < 0.75 * rank_fills[0][1]["full_bytes"], (rank, rank_fills)  # a share, not the model


def zero3_load(cfg, run_dir):
    """Pool task: one ZeRO-3 step from the checkpoint; every rank's shard-only init figures."""
    import torch.distributed as dist

    from plait.train.trainer import train

    figures = [None] * dist.get_world_size()
    dist.all_gather_object(figures, train(cfg, run_dir).strategy.init_memory)
    return figures


def test_a_ranks_peak_memory_while_loading_is_its_share_of_the_checkpoint(pool4, tiny_text, tmp_path):
    from safetensors import safe_open

    from plait.data import build_data
    from plait.models import build_model
    from plait.models.meta import build_on_meta, materialize
    from plait.train.job import check_job
    from plait.train.weights import checkpoint_parts

    big = llama_dir(tmp_path / "big", 0.02, **BIG)
    with safe_open(str(big / "model.safetensors"), framework="pt") as f:
        sizes = [f.get_slice(k).get_shape() for k in f.keys()]
    size = 4 * sum(torch.Size(s).numel() for s in sizes)  # S: fp32 on disk and in the model
    largest = 4 * max(torch.Size(s).numel() for s in sizes)
    figures = pool4.run(zero3_load, config(big, tiny_text, "parallel.dp=4", "parallel.zero=3", "train.steps=1",
                                           "train.global_batch_size=4", "train.micro_batch_size=1"),
                        tmp_path / "z3")[0]
    bound = size / 4 + 2 * largest / 4 + OVERHEAD
    for rank, f in enumerate(figures):
        grew = f["peak_rss_bytes"] - f["rss_before_bytes"]
        assert f["local_bytes"] == pytest.approx(size / 4, rel=0.01), (rank, f)
        assert grew <= bound < 0.75 * size, (rank, grew / 2**20, bound / 2**20)
    # The measurement sees memory: the whole checkpoint loaded the same way into one unsharded model grows by S.
    cfg = config(big, tiny_text, "parallel.dp=1")
    check_job(cfg)  # the [model] keys from config.json
    spec = build_data(cfg.data, cfg.model).spec
    module, _ = build_on_meta(lambda: build_model(cfg.model, spec))
    whole = materialize(module, checkpoint_parts(big, module), torch.device("cpu"))
    assert whole["peak_rss_bytes"] - whole["rss_before_bytes"] >= 0.9 * size, whole


def test_a_gpt2_checkpoint_is_padded_for_tp_and_read_in_slices(pool2, tiny_text, tmp_path):
    """GPT-2's vocabulary (here 171, odd as 50257 is) is padded to 64 rows' multiples, so tp2 splits it; each rank
    reads its rows of the transposed, split-in-three c_attn. tp2 keeps the one process's trajectory."""
    import test_equivalence

    config = transformers.GPT2Config(vocab_size=171, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                     bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")) else 0.0, 0.1)
    model.save_pretrained(tmp_path / "gpt2")
    cfg = lambda *more: load_config(None, [*[o for o in TINY_GPT if not o.startswith(("model.layers", "model.width",  # noqa: E731
                                                                                      "model.heads"))],
                                           "data.name='text'", f"data.path='{tiny_text}'",
                                           f"train.init_from='{tmp_path / 'gpt2'}'", *SGD, *more])
    ref = test_equivalence.trajectory(cfg("parallel.dp=1"), tmp_path / "ref")
    assert ref.params["tok_emb.weight"].shape[0] == 192 and ref.params["tok_emb.weight"][171:].abs().max() == 0
    got, fills = pool2.run(traced_trajectory, cfg("parallel.dp=1", "parallel.tp=2"), tmp_path / "tp2")[0]
    test_equivalence.assert_same_trajectory(ref, got)
    assert all({kind for kind, _ in rank_fills} == {"parts"} for rank_fills in fills)
