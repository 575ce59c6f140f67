"""Which rank owns which tensor: one balanced assignment for every scheme that splits tensors whole.

ZeRO-1's optimizer-state owners, the parameter server's shards and table-wise sharded embeddings
all place whole tensors on ranks. They use the LPT rule (Graham 1969, "longest processing time
first"): largest tensor first, each onto the rank with the least so far (ties: the lowest rank, then
the earlier tensor), so every rank computes the same map and the largest load is within 4/3 of the
best possible.
"""

from __future__ import annotations


def balanced_owners(sizes: list[int], ranks: int) -> list[int]:
    """Owner rank of each item, balancing the summed sizes over `ranks` (largest first onto the lightest rank)."""
    load = [0] * ranks
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner
