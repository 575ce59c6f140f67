"""Outliers across ranks: each rank embeds its shard, the embeddings go round a ring, every rank flags what one
process flags; the k-th-neighbour distances against scikit-learn's."""

from __future__ import annotations

import torch

from plait.audit.audit import outliers
from plait.audit.outliers import kth_distances, outliers_across_ranks


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 16, generator=g)
    x[7] += 9.0
    x[250] -= 7.0
    return x, torch.arange(300) * 3


def test_the_distances_are_scikit_learns_nearest_neighbours():
    from sklearn.neighbors import NearestNeighbors

    x, _ = _data()
    # 16 features, 16 components: the embedding is a rotation, so distances are the inputs' own
    want, _ = NearestNeighbors(n_neighbors=6).fit(x.double().numpy()).kneighbors(x.double().numpy())
    torch.testing.assert_close(kth_distances(x, 5), torch.from_numpy(want[:, 5]), rtol=0, atol=1e-9)


def _shard_task(x, src, cut):
    import torch.distributed as dist

    rank = dist.get_rank()
    local = x[:cut] if rank == 0 else x[cut:]
    return outliers_across_ranks(local, src, 5)


def test_two_ranks_with_uneven_shards_flag_what_one_process_flags(pool2):
    x, src = _data()
    alone = outliers(x, src)
    assert alone["indices"][:2] == [21, 750] and len(alone["indices"]) == 3  # the two moved samples first, 1 % of 300
    for got in pool2.run(_shard_task, x, src, 130):  # 130 and 170 samples
        assert got["indices"] == alone["indices"]
        assert got["scores"] == alone["scores"]
