"""Split a labelled training set across clients: IID, Dirichlet label skew, or label-sorted shards.

Every client process computes the same partition from (labels, clients, scheme, seed), so a
client needs only its id to know which samples are "its own" data; nothing is sent.

    parts = partition(labels, 10, "dirichlet", alpha=0.5, seed=1234)   # list of index arrays
    hist = label_histograms(labels, parts, num_classes=10)            # (clients, classes) counts
"""

from __future__ import annotations

import numpy as np

from plait.errors import ConfigError

MIN_DIRICHLET_SIZE = 10  # a client with fewer samples than this makes Dirichlet re-draw (as in Hsu et al. 2019 code)
MAX_DIRICHLET_DRAWS = 1000


def iid(n: int, clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """A random permutation cut into `clients` parts whose sizes differ by at most one."""
    return [np.sort(p) for p in np.array_split(rng.permutation(n), clients)]


def dirichlet(labels: np.ndarray, clients: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    """Label skew: for each class, its samples are split across clients in proportions ~ Dir(alpha).

    Hsu, Qi and Brown 2019, "Measuring the effects of non-identical data distribution for federated
    visual classification". Small alpha gives each client few labels; alpha -> inf approaches IID.
    The proportions are re-drawn while any client would get fewer than MIN_DIRICHLET_SIZE samples
    (at most half of an even share); when many clients share a small set and that keeps failing,
    the floor drops to one sample, so no client is ever empty.
    """
    labels = np.asarray(labels)
    by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    floors = sorted({min(MIN_DIRICHLET_SIZE, max(1, len(labels) // clients // 2)), 1}, reverse=True)
    for need in floors:
        for _ in range(MAX_DIRICHLET_DRAWS // len(floors)):
            parts: list[list[int]] = [[] for _ in range(clients)]
            for idx in by_class:
                idx = rng.permutation(idx)
                share = rng.dirichlet(np.full(clients, alpha))
                cuts = (np.cumsum(share)[:-1] * len(idx)).astype(int)
                for k, piece in enumerate(np.split(idx, cuts)):
                    parts[k].extend(piece.tolist())
            if min(len(p) for p in parts) >= need:
                return [np.sort(np.array(p, dtype=np.int64)) for p in parts]
    raise ConfigError(
        f"federated.alpha = {alpha}: {MAX_DIRICHLET_DRAWS} Dirichlet draws all left a client without samples; "
        f"raise federated.alpha or lower federated.clients ({clients})"
    )


def shards(labels: np.ndarray, clients: int, per_client: int, rng: np.random.Generator) -> list[np.ndarray]:
    """McMahan et al. 2017's pathological non-IID split: sort by label, cut into clients * per_client
    shards, give each client per_client random shards (so it sees about per_client labels)."""
    labels = np.asarray(labels)
    n_shards = clients * per_client
    if n_shards > len(labels):
        raise ConfigError(
            f"federated.clients ({clients}) * federated.shards_per_client ({per_client}) = {n_shards} shards "
            f"but the training set has only {len(labels)} samples; lower one of them"
        )
    order = np.argsort(labels, kind="stable")
    pieces = np.array_split(order, n_shards)
    assignment = rng.permutation(n_shards).reshape(clients, per_client)
    return [np.sort(np.concatenate([pieces[s] for s in row])) for row in assignment]


def partition(labels: np.ndarray, clients: int, scheme: str, alpha: float = 0.5, shards_per_client: int = 2,
              seed: int = 0) -> list[np.ndarray]:
    """Indices of each client's samples; disjoint, and together exactly the whole set."""
    labels = np.asarray(labels)
    if clients > len(labels):
        raise ConfigError(f"federated.clients = {clients} exceeds the {len(labels)} training samples; lower it")
    rng = np.random.default_rng(seed)
    if scheme == "iid":
        return iid(len(labels), clients, rng)
    if scheme == "dirichlet":
        return dirichlet(labels, clients, alpha, rng)
    if scheme == "shards":
        return shards(labels, clients, shards_per_client, rng)
    raise ConfigError(f"federated.partition = {scheme!r} is not one of: iid, dirichlet, shards")


def label_histograms(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """Counts of each label on each client, shape (clients, num_classes)."""
    labels = np.asarray(labels)
    return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts])
