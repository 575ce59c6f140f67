"""Ring, halving-doubling and hierarchical all-reduce (and the ring's halves, tree broadcast) against torch's own."""

import pytest

from plait.comm.bench import BenchOptions, bench_rank
from plait.testing import RankPool

SIZES = [1, 2, 5, 7, 64, 1001]  # incl. fewer elements than ranks and sizes no world size divides


@pytest.fixture(scope="module", params=[2, 3, 4])
def pool(request):
    with RankPool(request.param, timeout_s=60) as p:
        yield p


def compare_all_reduce(sizes):
    """Pool task: each algorithm's sum against dist.all_reduce's on the same random tensors; max abs difference."""
    import torch
    import torch.distributed as dist

    from plait.comm import algorithms as alg

    n = dist.get_world_size()
    worst, default = {}, alg.SEGMENT_BYTES
    for size in sizes:
        g = torch.Generator().manual_seed(1000 * size + dist.get_rank())
        x = torch.randn(size, generator=g)
        ints = torch.randint(-50, 50, (size,), generator=g).double()  # exact in any order of addition
        for data in (x, ints, x.reshape(1, -1)[:, ::2]):  # the last one is not contiguous
            want = data.clone()
            dist.all_reduce(want)
            for name, fn in (("ring", alg.ring_all_reduce), ("tree", alg.tree_all_reduce),
                             *((f"hier{k}", lambda t, k=k: alg.hierarchical_all_reduce(t, k)) for k in (2, 3)),
                             ("ring_segments", alg.ring_all_reduce), ("tree_segments", alg.tree_all_reduce),
                             ("hier2_segments", lambda t: alg.hierarchical_all_reduce(t, 2))):
                if name.endswith("segments") and (size != sizes[-1] or data is not ints):
                    continue  # 100-byte segments: several per chunk at the largest size, pipelined across the steps
                got = data.clone()
                alg.SEGMENT_BYTES = 100 if name.endswith("segments") else default
                fn(got)
                diff = float((got - want).abs().max()) if size else 0.0
                if data.dtype == torch.float64:
                    assert diff == 0.0, (name, size, n)
                worst[name] = max(worst.get(name, 0.0), diff)
    alg.SEGMENT_BYTES = default
    return worst


def test_all_reduce_algorithms_equal_dist_all_reduce(pool):
    for worst in pool.run(compare_all_reduce, SIZES):
        assert set(worst) == {"ring", "tree", "hier2", "hier3", "ring_segments", "tree_segments", "hier2_segments"}
        assert max(worst.values()) <= 1e-5, worst


def test_halving_doubling_with_a_rank_folded_in_on_5_ranks():
    """On 2 and 3 ranks the tree swaps whole vectors; on 5 one rank folds in ahead of a 4-rank halving-doubling
    (100-byte segments too, in compare_all_reduce's last size)."""
    with RankPool(5, timeout_s=60) as p:
        for worst in p.run(compare_all_reduce, [7, 1001]):
            assert max(worst["tree"], worst["tree_segments"]) <= 1e-5, worst


def compare_halves_and_broadcast(per_rank):
    """Pool task: ring reduce-scatter / all-gather and tree broadcast against torch's, on a subgroup too."""
    import torch
    import torch.distributed as dist

    from plait.comm import algorithms as alg

    n, r = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(r)
    x = torch.randint(-9, 9, (n * per_rank,), generator=g).double()
    want, got = torch.empty(per_rank, dtype=torch.float64), torch.empty(per_rank, dtype=torch.float64)
    dist.reduce_scatter_single(want, x.clone())
    alg.ring_reduce_scatter(got, x)
    assert torch.equal(want, got)
    mine = x[:per_rank]
    want, got = torch.empty(n * per_rank, dtype=torch.float64), torch.empty(n * per_rank, dtype=torch.float64)
    dist.all_gather_single(want, mine)
    alg.ring_all_gather(got, mine)
    assert torch.equal(want, got)
    for src in range(n):
        want, got = x.clone(), x.clone()
        dist.broadcast(want, src)
        alg.tree_broadcast(got, src)
        assert torch.equal(want, got)
    sub = dist.new_group(list(range(1, n)))  # ranks 1..n-1: global ranks differ from group ranks
    if r >= 1:
        want, got = x.clone(), x.clone()
        dist.all_reduce(want, group=sub)
        alg.ring_all_reduce(got, group=sub)
        assert torch.equal(want, got)
        alg.tree_all_reduce(x, group=sub)
        assert torch.equal(want, x)
    dist.destroy_process_group(sub)
    return True


def test_ring_halves_tree_broadcast_and_subgroups(pool):
    assert all(pool.run(compare_halves_and_broadcast, 3))


def gossip_mixing(topology, rounds):
    """Pool task: random vectors per rank; the consensus distance after each gossip round, and how far the mean moved."""
    import torch
    import torch.distributed as dist

    from plait.parallel.gossip import consensus_distance, gossip_average, neighbour_offsets

    x = [torch.randn(50, 3, generator=torch.Generator().manual_seed(dist.get_rank()), dtype=torch.float64)]
    mean0 = x[0].clone()
    dist.all_reduce(mean0)
    dists = [consensus_distance(x, None)]
    for _ in range(rounds):
        gossip_average(x, None, neighbour_offsets(dist.get_world_size(), topology))
        dists.append(consensus_distance(x, None))
    mean1 = x[0].clone()
    dist.all_reduce(mean1)
    return dists, float((mean0 - mean1).abs().max())


@pytest.mark.parametrize("topology", ["ring", "exponential"])
def test_gossip_mixing_shrinks_the_spread_by_lambda2_and_keeps_the_mean(pool, topology):
    """Gossip's averaging step (plait.parallel.gossip) on the same pools of 2, 3 and 4 ranks."""
    import cmath

    from plait.parallel.gossip import neighbour_offsets

    n = pool.world_size
    offsets = neighbour_offsets(n, topology)
    # The mixing matrix is circulant: eigenvalues (1 + sum_d e^(2 pi i d k / n)) / (|offsets| + 1).
    lam2 = max(abs(1 + sum(cmath.exp(2j * cmath.pi * d * k / n) for d in offsets)) / (len(offsets) + 1)
               for k in range(1, n))
    assert lam2 == pytest.approx({(2, "ring"): 0, (3, "ring"): 0, (4, "ring"): 1 / 3}.get((n, topology), 0), abs=1e-12)
    dists, drift = pool.run(gossip_mixing, topology, 4)[0]
    assert drift < 1e-12  # doubly stochastic: the average over ranks does not move
    for before, after in zip(dists, dists[1:]):
        assert after <= lam2 * before + 1e-12
    assert dists[0] > 1.0


def test_bench_sweep_rows_follow_the_busbw_formulas(pool):
    """`plait bench collectives` (plait.comm.bench) on the same pools."""
    opts = BenchOptions(ops=["allreduce", "allgather", "reduce_scatter", "broadcast"], algos=["native", "ring", "tree"],
                        sizes=[1000, 4096], iters=2, warmup=0, repeats=2).validate()
    rows = pool.run(bench_rank, opts)[0]
    n = pool.world_size
    combos = {(r["op"], r["algo"]) for r in rows}
    assert combos == {("allreduce", "native"), ("allreduce", "ring"), ("allreduce", "tree"), ("allgather", "native"),
                      ("allgather", "ring"), ("reduce_scatter", "native"), ("reduce_scatter", "ring"),
                      ("broadcast", "native"), ("broadcast", "tree")}
    factor = {"allreduce": 2 * (n - 1) / n, "allgather": (n - 1) / n, "reduce_scatter": (n - 1) / n, "broadcast": 1.0}
    for r in rows:
        assert r["correct"], r
        assert r["repeats"] == 2 and r["time_min_us"] <= r["time_us"] <= r["time_max_us"]
        assert r["vs_native"] == 1.0 if r["algo"] == "native" else r["vs_native"] > 0
        assert r["algbw_GBps"] == pytest.approx(r["size_bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * factor[r["op"]])
    assert {r["size_bytes"] for r in rows if r["op"] == "allreduce"} == {1000, 4096}
    assert all(r["size_bytes"] % (4 * n) == 0 for r in rows if r["op"] in ("allgather", "reduce_scatter"))


class Bucket:
    """What algorithm_hook reads of DDP's GradBucket (DDP itself is exercised by tests/comm/test_comm_allreduce_hook.py)."""

    def __init__(self, tensor):
        self.tensor = tensor

    def buffer(self):
        return self.tensor


def hook_average_and_bytes(algo, local_size):
    """Pool task: parallel.allreduce's DDP hook on a 2961-entry bucket; (error against the mean, counted, formula)."""
    import torch
    import torch.distributed as dist

    from plait.comm.accounting import AlgorithmHookState, CommCounter, algorithm_hook, counting
    from plait.comm.algorithms import bytes_sent

    n, r = dist.get_world_size(), dist.get_rank()
    grad = torch.randn(2961, generator=torch.Generator().manual_seed(r))  # no rank count here divides 2961
    mean = grad.clone()
    dist.all_reduce(mean)
    mean /= n
    counter = CommCounter()
    with counting(counter):
        got = algorithm_hook(AlgorithmHookState(None, algo, local_size), Bucket(grad.clone())).wait()
    return float((got - mean).abs().max()), counter.bytes_sent, counter.by_op["isend"], bytes_sent(algo, 2961, n, r, 4,
                                                                                                   local_size)


@pytest.mark.parametrize("algo, local_size", [("ring", 1), ("tree", 1), ("hierarchical", 2)])
def test_ddp_hook_averages_like_native_and_sends_the_formulas_bytes(pool, algo, local_size):
    """parallel.allreduce's DDP hook (plait.comm.accounting.algorithm_hook) on 2, 3 (tree folds a rank) and 4 ranks."""
    n = pool.world_size
    per_rank = pool.run(hook_average_and_bytes, algo, local_size)
    for err, counted, isend, formula in per_rank:
        assert err <= 1e-6
        assert counted == isend == formula  # every byte went through isend, as many as the formula says
    total = sum(r[1] for r in per_rank)
    if algo == "ring":
        assert total == 2 * (n - 1) * 2961 * 4  # each chunk travels n - 1 times in each half
    if algo == "tree" and n == 4:
        assert total == n * 2 * 3 / 4 * 2961 * 4  # 2 (p-1)/p of the tensor per rank
    if algo == "hierarchical":  # members hand the whole vector in and get it back; the leaders ring it
        nodes = -(-n // 2)
        assert total == (n - nodes) * 2 * 2961 * 4 + (2 * (nodes - 1) * 2961 * 4 if nodes > 1 else 0)
