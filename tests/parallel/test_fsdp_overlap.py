"""ZeRO-3 on CPU overlaps its collectives with compute (plait.parallel.fsdp.overlap_without_streams).

Asynchronous all-gathers and deferred reduce-scatters move the same bytes and compute the same numbers as
FSDP2's blocking collectives: the weights are equal, not just close.
"""

from helpers import max_diff, tiny_gpt_config


def overlapped_and_blocking(corpus, run_dir):
    """Pool task: 2 ZeRO-3 steps (2 micro-batches a rank) with the overlap and without; what rank 0 saw."""
    import torch
    import torch.distributed as dist

    import plait.parallel.fsdp as fsdp
    from plait.train.trainer import train

    cfg = tiny_gpt_config(corpus, "parallel.dp=2", "parallel.zero=3", "train.steps=2", "train.micro_batch_size=2",
                          "checkpoint.every=0")
    runs = {}
    for name in ("overlapped", "blocking"):
        original = fsdp.overlap_without_streams
        if name == "blocking":
            fsdp.overlap_without_streams = lambda *args: None  # FSDP2's own blocking collectives
        try:
            result = train(cfg, run_dir / name)
        finally:
            fsdp.overlap_without_streams = original
        strategy = result.strategy
        comm = strategy.reduce_scatter
        counts = (comm.calls, comm.deferred) if comm is not None else None
        # Two backwards without a step: the second adds into the sharded gradients, which FSDP2 does right
        # after the reduce-scatter call, so that one must not be deferred.
        g = torch.Generator().manual_seed(dist.get_rank())
        tokens = torch.randint(0, result.module.tok_emb.num_embeddings, (2, 33), generator=g)
        batches = [(tokens[:, :-1], tokens[:, 1:])]
        strategy.forward_backward(batches)
        strategy.forward_backward(batches)
        grads = {n: p.grad.full_tensor() for n, p in strategy.module.named_parameters()}
        runs[name] = (strategy.full_model_state_dict(), counts, grads, comm is not None and comm.defer)
    return runs if dist.get_rank() == 0 else None


def test_zero3_overlap_gives_the_blocking_weights(pool2, tiny_text, tmp_path):
    runs = pool2.run(overlapped_and_blocking, tiny_text, tmp_path)[0]
    (overlapped, counts, grads, deferred), (blocking, none, blocking_grads, _) = runs["overlapped"], runs["blocking"]
    assert max_diff(overlapped, blocking) == 0.0
    # 2 steps x 3 units (2 blocks and the root), each left in flight while backward went on; then the two
    # extra backwards: the first deferred (no gradients yet), the second not (it accumulates)
    assert counts == (6, 6) and none is None
    assert max_diff(grads, blocking_grads) == 0.0 and deferred is False
