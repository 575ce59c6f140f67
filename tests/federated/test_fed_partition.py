"""Partitions: every scheme covers the training set exactly once; Dirichlet skews labels, shards limit them."""

import numpy as np
import pytest

from plait.errors import ConfigError
from plait.federated.partition import label_histograms, partition

LABELS = np.random.default_rng(0).integers(0, 10, size=1618)


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "shards"])
def test_parts_are_disjoint_and_cover_the_dataset(scheme):
    parts = partition(LABELS, 10, scheme, alpha=0.5, shards_per_client=2, seed=3)
    joined = np.concatenate(parts)
    assert len(parts) == 10 and len(joined) == len(LABELS)
    assert np.array_equal(np.sort(joined), np.arange(len(LABELS)))
    hist = label_histograms(LABELS, parts, 10)
    assert hist.sum() == len(LABELS)
    assert np.array_equal(hist.sum(0), np.bincount(LABELS, minlength=10))  # label counts add up per class
    assert np.array_equal(hist.sum(1), [len(p) for p in parts])


def test_iid_sizes_differ_by_at_most_one():
    sizes = [len(p) for p in partition(LABELS, 7, "iid", seed=1)]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == len(LABELS)


def test_dirichlet_small_alpha_skews_labels_more_than_large_alpha():
    def skew(alpha):  # mean over clients of the share of its most common label
        hist = label_histograms(LABELS, partition(LABELS, 10, "dirichlet", alpha=alpha, seed=5), 10)
        return float((hist.max(1) / hist.sum(1)).mean())

    assert skew(0.1) > 0.5 > skew(100.0)
    assert skew(100.0) < 0.2  # near IID: about 1/10 plus noise


def test_dirichlet_is_deterministic_in_the_seed_and_leaves_nobody_empty():
    a = partition(LABELS, 10, "dirichlet", alpha=0.5, seed=9)
    b = partition(LABELS, 10, "dirichlet", alpha=0.5, seed=9)
    c = partition(LABELS, 10, "dirichlet", alpha=0.5, seed=10)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    assert min(len(p) for p in a) >= 10


def test_shards_give_each_client_few_labels():
    hist = label_histograms(LABELS, partition(LABELS, 10, "shards", shards_per_client=2, seed=2), 10)
    # two label-sorted shards of ~81 samples span at most 2 labels each (a shard can straddle a label boundary)
    assert ((hist > 0).sum(1) <= 4).all() and (hist > 0).sum(1).mean() <= 3


def test_impossible_partitions_are_user_errors():
    with pytest.raises(ConfigError, match="shards"):
        partition(LABELS[:10], 10, "shards", shards_per_client=2)
    with pytest.raises(ConfigError, match="exceeds"):
        partition(LABELS[:5], 10, "iid")


def test_a_hundred_clients_on_a_small_set_are_all_served():
    parts = partition(LABELS, 100, "dirichlet", alpha=0.5, seed=1234)
    assert min(len(p) for p in parts) >= 1 and sum(len(p) for p in parts) == len(LABELS)
