"""The continuous-batching engine: the scheduler's policy on a fake clock, paged attention against contiguous
attention, and greedy / seeded tokens equal to the model's own generate whatever the batch, preemption or prefix reuse."""

import asyncio
import math
import threading
import time

import pytest
import torch

from plait.models.gpt import GPT
from plait.models.llama import Llama
from plait.models.sampling import sample
from plait.serve.engine import kernels, paged
from plait.serve.engine.core import Engine, EngineConfig, SamplingParams, on_passing_thread
from plait.serve.engine.paged import PagedCache
from plait.serve.engine.scheduler import RUNNING, WAITING, BlockPool, Scheduler, block_keys
from plait.serve.service import ServeOptions


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def run_step(s: Scheduler, clock: Clock, token: int = 7):
    """One iteration of a fake engine: schedule, then 'sample' `token` for every chunk that reaches its end."""
    step = s.schedule()
    clock.now += 1.0
    s.update(step, {c.seq.id: token for c in step.chunks if c.sample})
    return step


# ---------------------------------------------------------------------- the policy


def test_chunked_prefill_runs_beside_decodes_and_memory_is_the_blocks_used():
    clock = Clock()
    pool = BlockPool(64, 4)
    s = Scheduler(pool, max_seqs=8, max_prefill_tokens=16, clock=clock)
    a = s.add(list(range(6)), max_tokens=10)
    step = run_step(s, clock)
    assert [(c.seq.id, c.start, c.count, c.sample) for c in step.chunks] == [(a.id, 0, 6, True)]
    assert a.first_token_at == 1.0 and a.output == [7]
    b = s.add(list(range(100, 140)), max_tokens=3)  # 40 tokens: chunks of at most 16 - 0 (the decode is free)
    steps = [run_step(s, clock) for _ in range(3)]
    assert [[(c.seq.id, c.start, c.count, c.sample) for c in st.chunks] for st in steps] == [
        [(a.id, 6, 1, True), (b.id, 0, 16, False)],
        [(a.id, 7, 1, True), (b.id, 16, 16, False)],
        [(a.id, 8, 1, True), (b.id, 32, 8, True)],
    ]
    assert b.first_token_at == 4.0 and len(a.output) == 4 and len(b.output) == 1
    # memory held: exactly the blocks the cached tokens need, not max length x batch
    assert pool.used == math.ceil(a.computed / 4) + math.ceil(b.computed / 4) == math.ceil(9 / 4) + math.ceil(40 / 4)
    while not s.idle:
        run_step(s, clock)
    assert a.finish_reason == b.finish_reason == "length" and (len(a.output), len(b.output)) == (10, 3)
    assert pool.used == 0


def test_decode_first_bounds_a_steps_tokens_and_prompt_chunks_fill_what_the_decodes_leave():
    clock = Clock()
    s = Scheduler(BlockPool(64, 4), max_seqs=8, max_prefill_tokens=16, clock=clock, max_step_tokens=6)
    a, b = s.add([1, 2, 3], max_tokens=20), s.add([4, 5], max_tokens=20)
    first = run_step(s, clock)
    assert [(c.seq.id, c.count) for c in first.chunks] == [(a.id, 3), (b.id, 2)]  # no decode yet: 6 prompt tokens
    long = s.add(list(range(100, 130)), max_tokens=2)
    steps = [run_step(s, clock) for _ in range(8)]
    # two decodes each step, the 30-token prompt in chunks of 6 - 2 = 4: every step runs 6 tokens at most
    assert [[(c.seq.id, c.count) for c in st.chunks] for st in steps[:2]] == [[(a.id, 1), (b.id, 1), (long.id, 4)]] * 2
    assert all(st.tokens <= 6 for st in steps) and long.first_token_at == 9.0
    unbounded = Scheduler(BlockPool(64, 4), max_seqs=8, max_prefill_tokens=16, clock=Clock())
    assert unbounded.max_step_tokens == 0


def test_admission_in_arrival_order_up_to_max_seqs_and_stop_tokens():
    clock = Clock()
    s = Scheduler(BlockPool(64, 4), max_seqs=2, max_prefill_tokens=64, clock=clock)
    seqs = [s.add([i, i + 1], max_tokens=5, stop_ids={9}) for i in range(3)]
    step = run_step(s, clock, token=1)
    assert [c.seq.id for c in step.chunks] == [0, 1] and [q.status for q in seqs] == [RUNNING, RUNNING, WAITING]
    step = s.schedule()
    s.update(step, {0: 9, 1: 1})  # sequence 0 draws its stop token: it ends now, its place goes to the next
    assert seqs[0].finish_reason == "stop" and seqs[0].output == [1, 9]
    assert [c.seq.id for c in run_step(s, clock).chunks] == [1, 2]


def test_a_full_pool_preempts_the_newest_sequence_which_keeps_its_tokens():
    clock = Clock()
    pool = BlockPool(4, 2)  # 8 token slots
    s = Scheduler(pool, max_seqs=4, max_prefill_tokens=64, clock=clock)
    old = s.add([1, 2, 3], max_tokens=4)
    new = s.add([4, 5, 6], max_tokens=4)
    run_step(s, clock)  # both prefilled: 2 + 2 blocks, each holds 3 tokens + its first output (not yet cached)
    assert pool.num_free == 0 and old.output == new.output == [7]
    step = run_step(s, clock)  # old's 4th token fits block 2; new's too: no new block yet
    assert not step.preempted
    step = s.schedule()  # both need a third block: the newest goes
    assert step.preempted == (new,) and [c.seq for c in step.chunks] == [old]
    assert new.status == WAITING and new.blocks == [] and new.computed == 0 and new.output == [7, 7]
    assert s.waiting[0] is new and s.preemptions == 1
    s.update(step, {old.id: 7})
    while not s.idle:
        run_step(s, clock)
    assert old.output == new.output == [7] * 4  # new recomputed its prompt and outputs, then went on


def test_prefix_blocks_are_shared_and_a_fully_cached_prompt_copies_its_last_block():
    clock = Clock()
    pool = BlockPool(16, 4)
    s = Scheduler(pool, max_seqs=4, max_prefill_tokens=64, clock=clock)
    system = list(range(10, 22))  # 12 tokens: 3 full blocks
    first = s.add(system + [1, 2], max_tokens=10)
    run_step(s, clock)
    assert first.keys == block_keys(first.tokens, 4)[:3]
    second = s.add(system + [3], max_tokens=10)
    step = run_step(s, clock)
    chunk = next(c for c in step.chunks if c.seq is second)
    assert (chunk.start, chunk.count) == (12, 1) and second.cached_tokens == 12
    assert second.blocks[:3] == first.blocks[:3] and all(pool.refs[b] == 2 for b in first.blocks[:3])
    third = s.add(list(system), max_tokens=2)  # every block cached: its last token is computed again, in a copy
    step = s.schedule()
    chunk = next(c for c in step.chunks if c.seq is third)
    assert (chunk.start, chunk.count) == (11, 1)
    assert step.copies == ((first.blocks[2], third.blocks[2]),) and third.blocks[:2] == first.blocks[:2]
    assert third.blocks[2] != first.blocks[2] and pool.refs[first.blocks[2]] == 2  # first and second
    assert pool.hit_tokens == 12 + 11 and pool.query_tokens == 14 + 13 + 12


def test_prefix_keys_chain_so_equal_blocks_after_different_prefixes_differ():
    a = block_keys([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_keys([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert a[0] != b[0] and a[1] != b[1]
    assert block_keys([1, 2, 3, 4], 4, salt="adapter") != block_keys([1, 2, 3, 4], 4)


def test_a_request_that_can_never_fit_is_refused_with_what_to_change():
    s = Scheduler(BlockPool(4, 16))
    with pytest.raises(ValueError) as e:
        s.add(list(range(60)), max_tokens=10)
    assert str(e.value) == ("the prompt (60 tokens) and max_tokens (10) need 5 KV-cache blocks of 16 tokens; the pool "
                            "has 4: ask for fewer tokens or serve with a larger --kv-cache-mb")


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    seen = {int(sample(logits, 1.0, None, torch.Generator().manual_seed(i), top_p=0.8)) for i in range(300)}
    assert seen == {0, 1}  # 0.5 < 0.8 <= 0.5 + 0.3
    seen = {int(sample(logits, 1.0, None, torch.Generator().manual_seed(i), top_p=0.81)) for i in range(300)}
    assert seen == {0, 1, 2}
    assert {int(sample(logits, 1.0, None, torch.Generator().manual_seed(i), top_p=0.1)) for i in range(50)} == {0}


# ---------------------------------------------------------------------- the engine on real models


def models():
    torch.manual_seed(0)
    llama = Llama(97, 256, 32, 4, 2, kv_heads=2).eval()
    windowed = Llama(97, 256, 32, 4, 2, kv_heads=4, sliding_window=8).eval()
    gpt = GPT(97, 96, 32, 4, 2).eval()
    return {"llama": llama, "llama-window": windowed, "gpt": gpt}


MODELS = models()
# head widths the compiled flash attention is built for (kernels.FLASH_HEAD_DIMS; the models above have 8 and 24)
FLASH_MODELS = {"llama-d32": Llama(97, 256, 64, 2, 2, kv_heads=1).eval(), "gpt-d32": GPT(97, 96, 64, 2, 2).eval()}
PROMPT_LENGTHS = (5, 17, 33, 1, 40, 16)


def prompts(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def greedy_reference(model, prompt, n):
    return model.generate(torch.tensor([prompt]), n, temperature=0)[0, len(prompt):].tolist()


def run_all(engine, requests):
    got = {i: [] for i in range(len(requests))}
    done = {}
    for i, (prompt, params) in enumerate(requests):
        engine.submit(prompt, params, lambda ev, i=i: got[i].append(ev.token), lambda r, i=i: done.__setitem__(i, r))
    engine.run()
    return [got[i] for i in range(len(requests))], done


@pytest.mark.parametrize("name", sorted(MODELS))
def test_paged_attention_gives_the_logits_of_contiguous_attention(name):
    model = MODELS[name]
    engine = Engine(model, EngineConfig(block_size=4, kv_cache_mb=1.0, max_prefill_tokens=24))
    ps = prompts()
    refs = [model(torch.tensor([p]))[0] for p in ps]
    for p in ps:  # prompt_logprobs: every token's logits are computed (else only each chunk's last one's)
        engine.submit(p, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    engine._drain_inbox()
    seen = {i: [] for i in range(len(ps))}
    with torch.inference_mode():
        while not engine.scheduler.idle:  # chunked prefills of several sequences in one forward
            step = engine.scheduler.schedule()
            logits, at = engine._forward(step)
            row = 0
            for c in step.chunks:
                seen[c.seq.id].append(logits[at[row]:at[row] + c.count])
                row += c.count
            engine.scheduler.update(step, {c.seq.id: 0 for c in step.chunks if c.sample})
    assert max(len(v) for v in seen.values()) > 1  # some prompt was split over steps
    for i, ref in enumerate(refs):
        torch.testing.assert_close(torch.cat(seen[i]), ref, atol=1e-5, rtol=1e-5)
    # without prompt log-probabilities a step computes the head on each sampling chunk's last token only
    engine.submit(ps[0], SamplingParams(max_tokens=2, temperature=0))
    engine._drain_inbox()
    step = engine.scheduler.schedule()
    with torch.inference_mode():
        logits, at = engine._forward(step)
    assert logits.shape[0] == sum(c.sample for c in step.chunks) and list(at) == [step.chunks[0].count - 1]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_tokens_equal_generate_whatever_the_batch(name):
    model = MODELS[name]
    ps = prompts()
    want = [greedy_reference(model, p, 20) for p in ps]
    requests = [(p, SamplingParams(max_tokens=20, temperature=0)) for p in ps]
    roomy = Engine(model, EngineConfig(block_size=4, kv_cache_mb=1.0, max_prefill_tokens=16))
    got, done = run_all(roomy, requests)
    assert got == want and set(done.values()) == {"length"} and roomy.pool.used == 0
    # a pool of 6 blocks of 16 tokens and 3 sequences at most: preemptions, recomputation, chunks of 7 tokens
    tight = Engine(model, EngineConfig(block_size=16, kv_cache_mb=6 * roomy.cache.bytes_per_block * 4 / 2**20,
                                       max_prefill_tokens=7, max_seqs=3))
    assert tight.pool.num_blocks == 6
    got, _ = run_all(tight, requests)
    assert got == want and tight.scheduler.preemptions > 0
    for p, w in zip(ps, want):  # alone
        alone, _ = run_all(Engine(model, EngineConfig(block_size=8, kv_cache_mb=1.0)), [(p, requests[0][1])])
        assert alone == [w]


def test_prefix_reuse_keeps_greedy_tokens_and_skips_the_shared_prompt():
    model = MODELS["llama"]
    system = prompts(2)[4]  # 40 tokens
    tails = [[1, 2, 3], [4], [], [5, 6, 7, 8, 9]]
    engine = Engine(model, EngineConfig(block_size=8, kv_cache_mb=1.0))
    for tail in tails:  # one after the other: each finds the blocks the ones before cached
        got, _ = run_all(engine, [(system + tail, SamplingParams(max_tokens=12, temperature=0))])
        assert got == [greedy_reference(model, system + tail, 12)]
    assert engine.pool.hit_tokens == 0 + 40 + 39 + 40  # 5 full blocks; the prompt equal to the prefix recomputes its last
    ran = engine.step_tokens
    run_all(engine, [(system + [11], SamplingParams(max_tokens=1, temperature=0))])
    assert engine.step_tokens - ran == 1  # only the new token ran through the model


def test_sequences_decoding_after_a_cached_system_prompt_keep_their_greedy_tokens_through_the_cascade(monkeypatch):
    monkeypatch.setenv("PLAIT_KERNELS", "off")  # the plain-torch attention's paths are what this test reads
    model = MODELS["llama"]
    system = prompts(2)[4]  # 40 tokens: 5 full blocks of 8
    tails = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11]]
    calls = []
    cascade = paged.PagedLayer._cascade
    monkeypatch.setattr(paged.PagedLayer, "_cascade", lambda self, q, y, *a: (calls.append(len(a[2][0])), cascade(self, q, y, *a)))
    engine = Engine(model, EngineConfig(block_size=8, kv_cache_mb=1.0))
    run_all(engine, [(system, SamplingParams(max_tokens=1, temperature=0))])  # caches the prefix
    got, _ = run_all(engine, [(system + t, SamplingParams(max_tokens=12, temperature=0)) for t in tails])
    assert got == [greedy_reference(model, system + t, 12) for t in tails]
    assert calls and max(calls) == len(tails)  # every layer of a step: the four decodes in one cascade


def test_seeded_sampling_gives_the_same_tokens_alone_or_batched():
    model = MODELS["llama"]
    ps = prompts(3)
    params = [SamplingParams(max_tokens=15, temperature=0.9, top_k=40, top_p=0.95, seed=100 + i) for i in range(len(ps))]
    batched, _ = run_all(Engine(model, EngineConfig(block_size=4, kv_cache_mb=1.0, max_prefill_tokens=9)),
                         list(zip(ps, params)))
    for p, sp, b in zip(ps, params, batched):
        alone, _ = run_all(Engine(model, EngineConfig(block_size=16, kv_cache_mb=1.0)), [(p, sp)])
        assert alone == [b]
    assert batched[0] != run_all(Engine(model), [(ps[0], SamplingParams(15, 0.9, 40, 0.95, seed=5))])[0][0]


def test_cancel_frees_the_blocks_and_logprobs_are_the_models():
    model = MODELS["gpt"]
    engine = Engine(model, EngineConfig(block_size=4, kv_cache_mb=1.0))
    events, done = [], []
    handle = engine.submit([1, 2, 3], SamplingParams(max_tokens=50, temperature=0, logprobs=3), events.append, done.append)
    for _ in range(4):
        engine.step()
    handle.cancel()
    engine.step()
    assert done == ["abort"] and len(events) == 4 and engine.pool.used == 0
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([[1, 2, 3]]))[0, -1], -1)
    first = events[0]
    assert first.token == int(ref.argmax()) and first.logprob == pytest.approx(float(ref.max()), abs=1e-5)
    assert [t for t, _ in first.top] == torch.topk(ref, 3).indices.tolist()


def test_requests_past_a_gpt_context_are_refused():
    engine = Engine(MODELS["gpt"], EngineConfig(block_size=4, kv_cache_mb=1.0))
    with pytest.raises(ValueError) as e:
        engine.submit(list(range(90)), SamplingParams(max_tokens=10))
    assert str(e.value) == "the prompt (90 tokens) and max_tokens (10) exceed the model's context of 96 positions"


# ---------------------------------------------------------------------- speculative decoding


def test_a_steps_rows_drawn_together_are_the_tokens_sample_draws_row_by_row():
    """The engine draws a step's rows at once per temperature (sample_rows): each row's token is the one `sample`
    draws for it alone with its own generator (same operations on the same numbers), greedy rows their argmax, and a
    row whose distribution is not one (all -inf, a NaN) None, the others unaffected."""
    from plait.models.sampling import sample_rows

    g = torch.Generator().manual_seed(0)
    for vocab in (50, 23470):
        logits = torch.randn(12, vocab, generator=g) * 3
        logits[4] = float("-inf")
        logits[5, 3] = float("nan")
        temps = [0.7, 1.0, 1.3, 0.0] * 3
        want = []
        for i in range(12):
            try:
                want.append(int(sample(logits[i], temps[i], None, torch.Generator().manual_seed(100 + i))))
            except ValueError as e:
                assert "not a distribution" in str(e)
                want.append(None)
        got = sample_rows(logits, temps, [torch.Generator().manual_seed(100 + i) for i in range(12)])
        assert got == want and got[4] is None and got[5] is None and sum(t is None for t in got) == 2


def test_the_acceptance_rule_gives_the_targets_distribution():
    """Leviathan et al.: P(x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y q(y) min(1, p(y)/q(y))) norm(max(0, p - q))(x) = p(x),
    on fixed logits, from the rule's own pieces; then the rule run 20000 times draws each token at p's frequency."""
    from plait.models.sampling import distribution
    from plait.serve.engine.speculative import accept_probability, residual, verify

    target = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    draft = torch.tensor([0.0, 2.0, 1.0, 0.5, -2.0])
    p, q = distribution(target[0], 0.8, None, 1.0), distribution(draft, 0.8, None, 1.0)
    accepted = sum(float(q[x]) * accept_probability(p, q, x) for x in range(5))
    total = torch.tensor([float(q[x]) * accept_probability(p, q, x) for x in range(5)]) + (1 - accepted) * residual(p, q)
    torch.testing.assert_close(total, p, atol=1e-6, rtol=0)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(5)
    for _ in range(20000):
        d = int(torch.multinomial(q, 1, generator=g))
        counts[verify(target, [d], [q], 0.8, None, 1.0, g)[0]] += 1
    assert (counts / 20000 - p).abs().max() < 0.012, (counts / 20000, p)
    # greedy: drafts are kept while they are the target's argmax, then the target's token
    assert verify(torch.eye(5)[[1, 2, 3]] * 3, [1, 2], [None, None], 0.0, None, 1.0, g) == [1, 2, 3]
    assert verify(torch.eye(5)[[1, 2, 3]] * 3, [1, 4], [None, None], 0.0, None, 1.0, g) == [1, 2]
    assert verify(torch.eye(5)[[1, 2, 3]] * 3, [0, 2], [None, None], 0.0, None, 1.0, g) == [1]


@pytest.mark.parametrize("draft", ["itself", "another"])
def test_speculative_greedy_tokens_equal_generate(draft):
    model = MODELS["llama"]
    torch.manual_seed(5)
    small = model if draft == "itself" else Llama(97, 256, 16, 2, 1).eval()
    ps = prompts()
    want = [greedy_reference(model, p, 20) for p in ps]
    requests = [(p, SamplingParams(max_tokens=20, temperature=0)) for p in ps]
    engine = Engine(model, EngineConfig(block_size=4, kv_cache_mb=1.0, max_prefill_tokens=16), draft=small,
                    num_speculative=3)
    got, done = run_all(engine, requests)
    assert got == want and set(done.values()) == {"length"} and engine.pool.used == 0
    rate = engine.stats()["acceptance_rate"]
    assert engine.proposed > 0 and (rate == 1.0 if draft == "itself" else rate < 0.5)
    steps_plain = sum(n for n in (20,) * len(ps))  # one token per sequence per step without a draft
    if draft == "itself":  # 3 drafts + 1 per step: far fewer steps than tokens
        assert engine.steps < steps_plain // 2
    tight = Engine(model, EngineConfig(block_size=16, kv_cache_mb=5 * roomy_bytes(model, small) / 2**20,
                                       max_prefill_tokens=7, max_seqs=3), draft=small, num_speculative=3)
    got, _ = run_all(tight, requests)
    assert got == want and tight.scheduler.preemptions > 0


def roomy_bytes(model, draft):
    from plait.serve.engine.paged import bytes_per_block

    return bytes_per_block(model, 16) + bytes_per_block(draft, 16)


def test_speculative_sampling_is_seeded():
    model = MODELS["llama"]
    torch.manual_seed(6)
    small = Llama(97, 256, 16, 2, 1).eval()
    ps = prompts(4)
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_k=30, seed=i) for i in range(len(ps))]
    runs = [run_all(Engine(model, EngineConfig(block_size=4, kv_cache_mb=1.0), draft=small, num_speculative=2),
                    list(zip(ps, params)))[0] for _ in range(2)]
    assert runs[0] == runs[1] and all(len(t) == 12 for t in runs[0])


# ---------------------------------------------------------------------- many LoRA adapters


def adapter_file(model, path, layers, rank, alpha, seed):
    """An adapters-only export with every A and B drawn at random (B at zero would hide a wrong scale or B)."""
    import json

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for n in layers:
        lin = model.get_submodule(n)
        tensors[n + ".lora_A"] = torch.randn(rank, lin.in_features, generator=g) * 0.3
        tensors[n + ".lora_B"] = torch.randn(lin.out_features, rank, generator=g) * 0.3
    save_file(tensors, str(path), metadata={"plait.lora": json.dumps({"rank": rank, "alpha": alpha, "targets": layers})})
    return tensors


def merged_copy(model, tensors, scale):
    import copy

    merged = copy.deepcopy(model)
    with torch.no_grad():
        for key, a in tensors.items():
            if key.endswith(".lora_A"):
                n = key[:-len(".lora_A")]
                merged.get_submodule(n).weight += (tensors[n + ".lora_B"] @ a) * scale
    return merged


@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_requests_for_different_adapters_share_a_batch_and_each_gets_its_merged_model(name, tmp_path):
    import copy

    from plait.serve.engine.adapters import install_adapters, load_adapter

    base = copy.deepcopy(MODELS[name])
    targets = {"llama": (["blocks.0.attn.q_proj", "blocks.0.attn.v_proj", "blocks.1.mlp.up_proj"],
                         ["blocks.1.attn.k_proj", "blocks.0.mlp.down_proj"]),
               "gpt": (["blocks.0.attn.q", "blocks.0.attn.v", "blocks.1.mlp.up"], ["blocks.1.attn.k", "blocks.0.mlp.down"])}[name]
    files = [adapter_file(base, tmp_path / f"a{i}.safetensors", layers, 4, 8.0 if i == 0 else 2.0, i)
             for i, layers in enumerate(targets)]
    refs = [MODELS[name], merged_copy(base, files[0], 2.0), merged_copy(base, files[1], 0.5)]
    adapters = [load_adapter(f"a{i}", tmp_path / f"a{i}.safetensors", base) for i in range(2)]
    router = install_adapters(base, adapters)
    engine = Engine(base, EngineConfig(block_size=4, kv_cache_mb=1.0, max_prefill_tokens=20), router=router)
    ps = prompts()
    got = {}
    for i, p in enumerate(ps):  # every prompt under every adapter and the base, all in one engine at once
        for a in range(3):
            engine.submit(p, SamplingParams(max_tokens=10, temperature=0),
                          lambda ev, k=(i, a): got.setdefault(k, []).append(ev.token), adapter=a)
    engine.run()
    for i, p in enumerate(ps):
        want = [greedy_reference(ref, p, 10) for ref in refs]
        assert [got[(i, a)] for a in range(3)] == want
    assert want[0] != want[1] and want[0] != want[2]  # the adapters change the answers
    with pytest.raises(ValueError, match="no LoRA adapter 3 is installed"):
        engine.submit(ps[0], SamplingParams(), adapter=3)
    if name == "gpt":  # gpt ties its head to the embedding: an adapter there would change both
        from plait.serve.errors import ServeError

        adapter_file(MODELS[name], tmp_path / "tied.safetensors", ["head"], 2, 2.0, 9)
        with pytest.raises(ServeError) as e:
            load_adapter("tied", tmp_path / "tied.safetensors", MODELS[name])
        assert str(e.value) == (f"--lora tied={tmp_path / 'tied.safetensors'}: head's weight is tied to tok_emb.weight; "
                                "an adapter there would change both")


def test_draw_follows_the_distribution_and_never_draws_a_zero():
    from plait.models.sampling import draw

    probs = torch.tensor([0.5, 0.0, 0.2, 0.3, 0.0])
    g = torch.Generator().manual_seed(0)
    got = draw(probs.expand(40_000, 5), g)[:, 0]
    freq = torch.bincount(got, minlength=5).double() / 40_000
    assert freq[1] == freq[4] == 0 and torch.allclose(freq, probs.double(), atol=0.01)  # 4 sigma of 40k draws
    assert draw(torch.tensor([0.0, 0.0, 1e-30]), g).item() == 2  # tiny but positive: the only one it may draw
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert [draw(probs, g1).item() for _ in range(20)] == [draw(probs, g2).item() for _ in range(20)]


def test_the_gather_of_blocks_is_the_same_on_one_thread_and_on_several():
    cache = PagedCache(MODELS["llama"], num_blocks=12, block_size=4)
    pool = next(iter(cache.k.values()))
    heads, _, d = pool.shape
    with torch.inference_mode():
        pool.copy_(torch.randn(pool.shape))
        blocks = torch.tensor([5, 2, 9, 2, 11])
        want = pool.view(heads, 12, 4, d)[:, blocks].reshape(heads, -1, d).clone()
        before = torch.get_num_threads()
        try:
            for threads in (1, 2):  # one thread: along the pool's block dimension; more: a head at a time
                torch.set_num_threads(threads)
                assert torch.equal(cache.gather(pool, blocks, 0), want)
                assert torch.equal(cache.gather(pool, blocks[:2], 0), want[:, :8])  # the kept buffer, smaller
        finally:
            torch.set_num_threads(before)


def test_block_tables_split_into_runs_read_in_place_and_slots_gathered(monkeypatch):
    monkeypatch.setattr(paged, "IN_PLACE_RUN", 3)
    # blocks of 4 tokens; runs of at least 3 consecutive blocks are read in place, the rest slot by slot
    runs, rest = paged._parts([5, 6, 7, 8, 2, 14, 15, 16], 4, 0, 30)
    assert runs == [(20, 36), (56, 66)] and rest == [8, 9, 10, 11]
    assert paged._parts([5, 6, 7, 8, 2, 14, 15, 16], 4, 22, 30) == ([(58, 66)], [])  # a window's first key: 22
    assert paged._parts([3, 4], 4, 0, 7) == ([], [12, 13, 14, 15, 16, 17, 18])


def attend_both_ways(name, num_blocks, seed, chunks, monkeypatch, switch, off, on):
    """One layer's attention of a step of `chunks` over a pool of random keys and values, with the module constant
    `switch` at `off`, then at `on` (or switch(cache, value) when it is a function): (step, output) of each, from the
    same pool, queries and new keys."""
    monkeypatch.setattr(paged, "IN_PLACE_RUN", 3)
    model = MODELS[name] if name in MODELS else FLASH_MODELS[name]
    cache = PagedCache(model, num_blocks=num_blocks, block_size=4)
    layer = next(iter(cache.k))
    kv_heads, _, d = cache.k[layer].shape
    heads, tokens = model.blocks[layer].attn.heads, sum(c[2] for c in chunks)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, tokens, d, generator=g)
    k, v = torch.randn(1, kv_heads, tokens, d, generator=g), torch.randn(1, kv_heads, tokens, d, generator=g)
    out = []
    with torch.inference_mode():
        cache.k[layer].copy_(torch.randn(cache.k[layer].shape, generator=g))
        cache.v[layer].copy_(torch.randn(cache.v[layer].shape, generator=g))
        for value in (off, on):
            if callable(switch):
                switch(cache, value)
            else:
                monkeypatch.setattr(paged, switch, value)
            step = cache.step(chunks)
            out += [step, step.layer(layer).attend(q, k, v)]
    return out


@pytest.mark.parametrize("name", ["llama", "llama-window"])
def test_a_decode_read_in_place_attends_as_the_gathered_one(name, monkeypatch):
    monkeypatch.setenv("PLAIT_KERNELS", "off")  # the plain-torch attention's paths are what this test reads
    # one table of a run, a lone block and a run; one of a lone run; one of short pieces only
    tables = [[5, 6, 7, 8, 9, 2, 14, 15, 16, 30], [20, 21, 22, 23, 24, 25], [1, 3, 11]]
    chunks = [(t, len(t) * 4 - 2, 1) for t in tables]  # each decoding its block table's second last slot
    gathered, want, step, got = attend_both_ways(name, 32, 3, chunks, monkeypatch, "IN_PLACE_KEYS", 10**9, 1)
    assert gathered.decode_groups and not gathered.in_place and not step.decode_groups
    assert [(len(runs), rest is not None) for _, runs, rest in step.in_place] == (
        [(2, True), (1, False), (0, True)] if name == "llama" else [(0, True), (1, False), (0, True)])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_a_later_prompt_chunk_merged_by_log_sum_exp_attends_as_the_masked_one(name, monkeypatch):
    # chunks of 5 and 3 tokens after 30 and 7 cached ones: earlier keys in a run, a lone block and a run; in pieces
    chunks = [([5, 6, 7, 8, 9, 2, 14, 15, 16, 30], 30, 5), ([1, 3, 11], 7, 3)]
    masked, want, merged, got = attend_both_ways(name, 32, 4, chunks, monkeypatch, "MERGED_CHUNKS", False, True)
    assert len(masked.prefills) == 2 and not masked.continued and not merged.prefills
    assert [(len(runs), rest is not None) for _, _, runs, rest in merged.continued] == [(1, True), (0, True)]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_decodes_sharing_a_prefix_attend_it_once_as_each_attends_it_alone(name, monkeypatch):
    monkeypatch.setenv("PLAIT_KERNELS", "off")  # the plain-torch attention's paths are what this test reads
    # three decodes after the same 5 cached blocks (a run of 4 and a lone one), one after 2 of them, one alone
    shared = [10, 11, 12, 13, 3]
    chunks = [(shared + [20], 22, 1), (shared + [21, 22], 26, 1), (shared + [30], 21, 1), (shared[:2] + [33], 10, 1),
              ([36, 37], 6, 1)]
    alone, want, step, got = attend_both_ways(name, 40, 5, chunks, monkeypatch, "SHARED_PREFIX_BLOCKS", 0, 4)
    assert not alone.cascades and len(step.cascades) == 1
    runs, others, (rows, _, _) = step.cascades[0]
    assert runs == [(40, 56)] and others.tolist() == [12, 13, 14, 15] and rows.tolist() == [0, 1, 2]
    assert sorted(r for g in step.decode_groups for r in g[0].tolist()) == [3, 4]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_tokens_equal_generate_with_every_decode_read_in_place(name, monkeypatch):
    monkeypatch.setattr(paged, "IN_PLACE_KEYS", 1)
    monkeypatch.setattr(paged, "IN_PLACE_RUN", 2)
    model = MODELS[name]
    ps = prompts()
    want = [greedy_reference(model, p, 20) for p in ps]
    requests = [(p, SamplingParams(max_tokens=20, temperature=0)) for p in ps]
    engine = Engine(model, EngineConfig(block_size=4, kv_cache_mb=1.0, max_prefill_tokens=16))
    got, _ = run_all(engine, requests)
    assert got == want and engine.pool.used == 0


def test_a_sequence_grows_into_the_block_after_its_last_when_that_one_is_free():
    pool = BlockPool(8, 4)
    a = [pool.allocate(None), pool.allocate(0), pool.allocate(1)]
    b = [pool.allocate(None) for _ in range(3)]
    assert a == [0, 1, 2] and b == [3, 4, 5]
    pool.register(4, 1234)  # block 4 will hold a cached prefix
    for block in b:
        pool.release(block)
    assert list(pool.free) == [6, 7, 3, 4, 5]
    assert pool.allocate(2) == 3  # the block after a's last, not the least recently freed (6)
    assert pool.allocate(3) == 6  # 4 keeps its cached prefix: the least recently freed instead
    assert pool.lookup(1234) == 4 and list(pool.free) == [7, 4, 5]


def test_the_llm_engine_takes_every_core_and_static_batches_leave_one_to_the_event_loop(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    opts = ServeOptions()
    assert opts.threads_per(1, in_process=True, engine=True) == 8  # the engine's event loop only hands tokens on
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # a machine shared with other work says how many
    assert opts.threads_per(1, in_process=True, engine=True) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "")
    assert opts.threads_per(1, in_process=True, engine=True) == 8
    assert opts.threads_per(1, in_process=True) == 7
    assert opts.threads_per(4) == 2
    assert ServeOptions(threads=3).threads_per(1, in_process=True, engine=True) == 3


def test_the_engine_thread_keeps_its_thread_count_whatever_another_thread_sets_later():
    model = MODELS["llama"]
    seen: list[int] = []
    hook = model.register_forward_pre_hook(lambda module, args: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    engine = Engine(model, EngineConfig(block_size=4, kv_cache_mb=1.0), threads=2)
    done = threading.Event()
    try:
        engine.start()
        time.sleep(0.2)
        torch.set_num_threads(1)  # the server's own threads set theirs once the engine's is up
        engine.submit([1, 2, 3], SamplingParams(max_tokens=2, temperature=0), on_done=lambda reason: done.set())
        assert done.wait(30)
    finally:
        engine.stop()
        hook.remove()
        torch.set_num_threads(before)
    assert seen and set(seen) == {2}  # a thread's first parallel op no longer takes the process-wide count


class _Digits:
    """A grammar of digits only, recording the thread each mask was computed on."""

    def __init__(self):
        self.threads: list[str] = []
        self.accepted: list[int] = []

    def allowed(self, vocab: int) -> torch.Tensor:
        self.threads.append(threading.current_thread().name)
        time.sleep(0.002)  # a mask that takes a while: the step must wait for it, never read a half-made one
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[10:20] = True
        return mask

    def accept(self, token: int) -> None:
        self.accepted.append(token)


def test_a_grammars_mask_is_computed_on_the_mask_thread_during_the_forward_and_gives_the_same_tokens():
    model = MODELS["llama"]
    grammars: list[_Digits] = []

    def digits() -> _Digits:
        grammars.append(_Digits())
        return grammars[-1]

    params = SamplingParams(max_tokens=6, temperature=0, grammar=digits)
    engine = Engine(model, EngineConfig(block_size=4, kv_cache_mb=1.0))
    got: list[int] = []
    engine.submit([1, 2, 3], params, lambda ev: got.append(ev.token))
    engine.run()
    with torch.no_grad():  # the masked argmax of the model's own logits, token by token
        ids, want = [1, 2, 3], []
        for _ in range(6):
            logits = model(torch.tensor([ids]))[0, -1]
            want.append(int(logits.masked_fill(~(torch.arange(logits.shape[-1]) // 10 == 1), float("-inf")).argmax()))
            ids.append(want[-1])
    assert got == want and grammars[0].accepted == want
    # the first mask is computed by the step itself (the logits' width is not known before), the others ahead of
    # each forward on the mask thread
    assert grammars[0].threads[0] == threading.current_thread().name
    assert all(t.startswith("plait-grammar") for t in grammars[0].threads[1:]) and len(grammars[0].threads) == 6


def test_a_steps_tokens_reach_the_loop_in_order_in_one_wake_up():
    from plait.serve.executor.sequences import Mailbox

    async def main():
        loop = asyncio.get_running_loop()
        wakeups, got, errors = [], [], []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda fn, *a: (wakeups.append(fn), real(fn, *a))[1]  # type: ignore[method-assign]
        loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx["exception"]))
        box = Mailbox(loop)

        def engine_step(first: int) -> None:  # the engine's thread: a step's tokens, one of them a bad callback
            for i in range(first, first + 50):
                box.post(got.append, i)
            box.post(lambda: 1 / 0)

        for first in (0, 50):
            thread = threading.Thread(target=engine_step, args=(first,))
            thread.start()
            thread.join()
            await asyncio.sleep(0.01)
        return wakeups, got, errors

    wakeups, got, errors = asyncio.run(main())
    assert got == list(range(100)) and len(wakeups) == 2
    assert [type(e) for e in errors] == [ZeroDivisionError, ZeroDivisionError]


@pytest.fixture(scope="module")
def decode_kernel():
    """plait's compiled decode attention (plait.serve.engine.kernels): built once per machine (about a minute), loaded
    from its cache after; the suite runs with PLAIT_KERNELS=off otherwise (tests/conftest.py)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLAIT_KERNELS", "on")
        fn = kernels.paged_decode()
    if fn is None:
        pytest.skip(f"the decode kernel cannot be built here ({kernels.why_not()}): it needs g++ and ninja")
    return fn


@pytest.mark.parametrize("name", ["llama", "llama-window", "gpt"])
def test_the_compiled_decode_attention_attends_as_the_plain_torch_one(name, decode_kernel, monkeypatch):
    # fragmented tables, a lone block, a one-key sequence, and a prompt chunk beside them (which the kernel leaves)
    tables = [[5, 6, 7, 8, 9, 2, 14, 15, 16, 30], [20, 21, 22, 23, 24, 25], [1, 3, 11], [31]]
    chunks = [(t, len(t) * 4 - 2, 1) for t in tables] + [([12, 13], 0, 6), ([26], 0, 1)]
    torch_step, want, kernel_step, got = attend_both_ways(
        name, 32, 7, chunks, monkeypatch, lambda cache, fn: setattr(cache, "decode_kernel", fn), None, decode_kernel)
    assert torch_step.kernel is None and kernel_step.kernel[0].tolist() == [0, 1, 2, 3, 10]
    assert not kernel_step.decode_groups and not kernel_step.in_place and not kernel_step.cascades
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_tokens_equal_generate_through_the_compiled_decode_attention(name, decode_kernel, monkeypatch):
    monkeypatch.setenv("PLAIT_KERNELS", "on")
    greedy_equals_generate_through(MODELS[name], 20, "decode_kernel", decode_kernel)


def greedy_equals_generate_through(model, n: int, kernel: str, fn) -> None:
    """An engine (prompt chunks of 16) whose cache holds the compiled `fn` as its `kernel` gives generate's greedy
    tokens for every prompt, and frees its blocks."""
    ps = prompts()
    want = [greedy_reference(model, p, n) for p in ps]
    engine = Engine(model, EngineConfig(block_size=4, kv_cache_mb=1.0, max_prefill_tokens=16))
    assert getattr(engine.cache, kernel) is fn
    got, _ = run_all(engine, [(p, SamplingParams(max_tokens=n, temperature=0)) for p in ps])
    assert got == want and engine.pool.used == 0


def test_the_compiled_decode_attention_refuses_keys_outside_the_block_table(decode_kernel):
    pool = torch.zeros(1, 8, 4)
    q, tables = torch.zeros(1, 1, 4), torch.tensor([[0]])
    with pytest.raises(RuntimeError, match=r"paged_decode: sequence 0 keys 0\.\.5 outside its block table"):
        decode_kernel(q, pool, pool, tables, torch.tensor([0]), torch.tensor([5]), 4, 0.5)


def test_the_compiled_decode_attention_refuses_a_block_outside_the_pool(decode_kernel):
    pool = torch.zeros(1, 8, 4)  # two blocks of 4
    q, tables = torch.zeros(1, 1, 4), torch.tensor([[0, 2]])
    with pytest.raises(RuntimeError, match=r"paged_decode: sequence 0 block 2 outside the pool"):
        decode_kernel(q, pool, pool, tables, torch.tensor([0]), torch.tensor([6]), 4, 0.5)


def test_what_builds_an_engine_runs_on_a_passing_thread_with_the_callers_thread_count():
    """plait serve builds its Service (model, engine) so: the main thread then keeps no OpenMP team beside the engine
    thread's (on_passing_thread says why)."""
    seen = {}

    def build(a, b=0):
        seen.update(thread=threading.current_thread(), threads=torch.get_num_threads())
        return a + b

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert on_passing_thread(build, 1, b=2) == 3
    finally:
        torch.set_num_threads(before)
    assert seen["thread"].name == "plait-load" and seen["thread"] is not threading.current_thread()
    assert not seen["thread"].is_alive() and seen["threads"] == 2

    def fail():
        raise ValueError("no such checkpoint")

    with pytest.raises(ValueError, match="^no such checkpoint$"):
        on_passing_thread(fail)


def test_the_compiled_decode_attention_keeps_its_threads_torch_thread_count(decode_kernel):
    """The engine's thread sets its own count; the server's other threads set 1 after it (its runner's). The kernel's
    first call on the engine's thread took that 1 (ATen's parallel_for set-up, inlined in the kernel) and the whole
    engine then ran on one thread behind `plait serve`."""
    gen = torch.Generator().manual_seed(3)
    pool = torch.randn(2, 64, 8, generator=gen)
    q, tables = torch.randn(3, 4, 8, generator=gen), torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])
    counts = {}

    def engine_thread():
        torch.get_num_threads()  # as Engine._loop: this thread's own set-up first, then its count
        torch.set_num_threads(2)
        other = threading.Thread(target=torch.set_num_threads, args=(1,))
        other.start()
        other.join()
        decode_kernel(q, pool, pool, tables, torch.tensor([0, 0, 3]), torch.tensor([16, 5, 9]), 4, 0.5)
        counts["after"] = torch.get_num_threads()

    before = torch.get_num_threads()
    try:
        thread = threading.Thread(target=engine_thread)
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(before)
    assert counts == {"after": 2}


@pytest.fixture(scope="module")
def flash_kernel():
    """The compiled flash attention for prompt chunks (the same module as the decode kernel)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLAIT_KERNELS", "on")
        fn = kernels.flash_attention(any_machine=True)
    if fn is None:
        pytest.skip(f"the attention kernels cannot be built here ({kernels.why_not()}): they need g++ and ninja")
    return fn


@pytest.mark.parametrize("heads, kv_heads, m, n, d, causal", [
    (4, 2, 1, 1, 64, True), (4, 2, 5, 5, 64, True), (3, 3, 67, 67, 32, True), (4, 2, 130, 300, 64, True),
    (4, 4, 130, 300, 64, False), (2, 1, 3, 77, 128, False), (2, 1, 100, 100, 128, True), (4, 2, 1, 200, 64, True)])
def test_the_compiled_flash_attention_gives_softmax_attention_and_its_log_sum_exp(heads, kv_heads, m, n, d, causal,
                                                                                 flash_kernel):
    """Against the float64 formula: query i sees keys 0 .. i + n - m when causal (its chunk's own position and
    earlier), all n otherwise; query head h reads key head h // (heads // kv_heads); q is a transposed (strided)
    view, as the engine hands it over. Lengths off the kernel's blocks of 4 queries, 64 queries and 64 keys."""
    g = torch.Generator().manual_seed(m * 1000 + n)
    q = torch.randn(m, heads, d, generator=g).transpose(0, 1)
    k, v = torch.randn(kv_heads, n, d, generator=g), torch.randn(kv_heads, n, d, generator=g)
    out, lse = flash_kernel(q, k, v, causal, d ** -0.5)
    kk, vv = (t.double().repeat_interleave(heads // kv_heads, 0) for t in (k, v))
    scores = q.double() @ kk.transpose(1, 2) * d ** -0.5
    if causal:
        scores = scores.masked_fill(torch.arange(n)[None] > torch.arange(m)[:, None] + (n - m), float("-inf"))
    torch.testing.assert_close(out, (scores.softmax(-1) @ vv).float(), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse, scores.logsumexp(-1).float(), atol=2e-6, rtol=1e-6)


def test_the_compiled_flash_attention_refuses_what_it_is_not_built_for(flash_kernel):
    q = torch.zeros(2, 3, 48)
    with pytest.raises(RuntimeError, match=r"flash_attention: head width 48 \(32, 64 or 128 only\)"):
        flash_kernel(q, q, q, True, 0.1)
    with pytest.raises(RuntimeError, match="flash_attention: causal needs at least as many keys as queries"):
        flash_kernel(torch.zeros(2, 3, 32), torch.zeros(2, 2, 32), torch.zeros(2, 2, 32), True, 0.1)
    with pytest.raises(RuntimeError, match="flash_attention: float32 only"):
        flash_kernel(q.double(), q.double(), q.double(), False, 0.1)


def test_the_flash_attention_is_used_only_with_the_vectors_it_was_measured_faster_with(flash_kernel, monkeypatch):
    monkeypatch.setenv("PLAIT_KERNELS", "on")
    width = kernels._module(False, None).vector_width()
    assert width in (4, 8, 16)
    monkeypatch.setattr(kernels, "FLASH_MIN_VECTOR", width)
    assert kernels.flash_attention() is flash_kernel
    monkeypatch.setattr(kernels, "FLASH_MIN_VECTOR", 2 * width)
    assert kernels.flash_attention() is None and kernels.why_not("flash_attention") == (
        f"built for {width}-float vectors, where SDPA's is as fast (it is used from {2 * width}: AVX-512)")
    assert PagedCache(FLASH_MODELS["llama-d32"], num_blocks=4, block_size=4).prefill_kernel is None


@pytest.mark.parametrize("name", sorted(FLASH_MODELS))
def test_prompt_chunks_through_the_compiled_flash_attention_attend_as_sdpa(name, flash_kernel, monkeypatch):
    # two prompts' first chunks, two later chunks after 30 and 7 cached keys (in a run, a
    # lone block and a run; in pieces), and a decode beside them, which the flash kernel leaves
    chunks = [([12, 13, 17], 0, 9), ([26], 0, 3), ([5, 6, 7, 8, 9, 2, 14, 15, 16, 30], 30, 5), ([1, 3, 11], 7, 3),
              ([20, 21, 22], 10, 1)]
    sdpa_step, want, flash_step, got = attend_both_ways(
        name, 32, 9, chunks, monkeypatch, lambda cache, fn: setattr(cache, "prefill_kernel", fn), None, flash_kernel)
    assert len(flash_step.prefills) == 2 and len(flash_step.continued) == 2
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(FLASH_MODELS))
def test_greedy_tokens_equal_generate_through_the_compiled_flash_attention(name, flash_kernel, monkeypatch):
    monkeypatch.setenv("PLAIT_KERNELS", "on")
    monkeypatch.setattr(kernels, "FLASH_MIN_VECTOR", 0)  # used on any machine here
    greedy_equals_generate_through(FLASH_MODELS[name], 12, "prefill_kernel", flash_kernel)


@pytest.mark.parametrize("value, on", [(None, True), ("off", False), ("0", False), ("No", False), ("on", True),
                                      ("1", True)])
def test_the_compiled_decode_attention_is_on_unless_turned_off(value, on, monkeypatch):
    if value is None:
        monkeypatch.delenv("PLAIT_KERNELS", raising=False)
    else:
        monkeypatch.setenv("PLAIT_KERNELS", value)
    assert kernels.wanted() is on
    if not on:
        assert kernels.paged_decode() is None and kernels.why_not() == "PLAIT_KERNELS is off"


def test_the_engines_linears_run_on_packed_weights_from_4_rows_and_nowhere_else(monkeypatch):
    """With PLAIT_KERNELS on, the engine gives each float32 nn.Linear of its model a oneDNN-packed copy of its weight,
    used inside its forward from 4 rows a step (a decode batch, a prompt's chunk), and from one row where its shape
    timed faster so: there within 1e-5 of F.linear, elsewhere F.linear itself, bit for bit, also for the same model
    used outside the engine; greedy tokens stay transformers-equal (test above). Off: nothing packed."""
    import copy

    from plait.models.llama import Llama

    torch.manual_seed(0)
    model = Llama(vocab_size=97, context=64, width=32, heads=4, layers=2, kv_heads=2, hidden=64).eval()
    monkeypatch.setenv("PLAIT_KERNELS", "off")
    assert Engine(copy.deepcopy(model), EngineConfig(block_size=4, kv_cache_mb=1.0)).packed == 0
    monkeypatch.setenv("PLAIT_KERNELS", "on")
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    plain = copy.deepcopy(model)
    timed = []
    one_row = kernels.one_row_packed
    monkeypatch.setattr(kernels, "one_row_packed", lambda layer, w: timed.append(layer) or (
        layer.out_features == 64 or one_row(layer, w)))  # up and gate (32 -> 64): packed at one row too
    engine = Engine(model, EngineConfig(block_size=4, kv_cache_mb=1.0))
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert engine.packed == len(layers) == 2 * 7 + 1  # q, k, v, o, gate, up, down a block, and the head
    assert timed == layers  # each layer's one-row choice made once, when packed
    layer = model.get_submodule("blocks.0.mlp.up_proj")
    down = model.get_submodule("blocks.0.mlp.down_proj")
    assert kernels._PACKED[layer][1] == 1
    kernels._PACKED[down] = (kernels._PACKED[down][0], kernels.PACKED_MIN_ROWS)  # F.linear below 4 rows
    calls = []
    matmul = kernels.packed_matmul
    monkeypatch.setattr(kernels, "packed_matmul", lambda *a: calls.append(a[0].shape[1]) or matmul(*a))
    g = torch.Generator().manual_seed(1)
    for rows in (1, 3, 4, 8, 256, 257):
        for lin in (layer, down):
            x = torch.randn(1, rows, lin.in_features, generator=g)
            want = torch.nn.functional.linear(x, lin.weight, lin.bias)
            assert torch.equal(lin(x), want)  # outside an engine's forward
            with kernels.packed_forward():
                torch.testing.assert_close(lin(x), want, atol=1e-5, rtol=0)
    # the packed matmul ran inside the forward only: up from one row, down from 4
    assert calls == [1, 3, 4, 4, 8, 8, 256, 256, 257, 257]
    ids = torch.randint(0, 97, (1, 12), generator=g)
    assert torch.equal(model(ids), plain(ids))  # the model outside the engine: as it was
    twin = copy.deepcopy(model)  # a copy (adapters merged into one, say) is plain nn.Linear layers again
    with kernels.packed_forward():
        twin.get_submodule("blocks.0.mlp.up_proj")(torch.randn(1, 8, layer.in_features))
    assert len(calls) == 10
    # greedy tokens through the packed layers: generate's (a batch of 6 decodes and prompt chunks of 4-16 rows)
    ps = prompts()
    want = [greedy_reference(plain, p, 12) for p in ps]
    got, _ = run_all(engine, [(p, SamplingParams(max_tokens=12, temperature=0)) for p in ps])
    assert got == want and len(calls) > 3
