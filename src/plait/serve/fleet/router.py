"""Which replica's engine gets a sequence: the one whose KV cache holds the longest prefix of its prompt.

Each replica's engine caches full KV blocks under prefix keys, a chain of hashes over the blocks' tokens
(plait.serve.engine.scheduler.block_keys): two prompts share a cached block only if they agree on every token up to
its end. The router keeps, per replica, the keys of the prompts it sent there, most recently sent last, at most as
many as that replica's pool has blocks (its engine evicts the least recently freed block first, so older keys are
the likeliest gone). A prompt goes to the replica holding the most of its leading keys; a prompt that no replica
holds goes to the least loaded one (ties: the one holding fewer keys, then the lowest index), and so does one whose
best replica runs `max_imbalance` more sequences than the least loaded (SGLang's cache-aware router balances the
same way). Least-loaded and round-robin routing are the baselines the benchmark compares it with
(benchmarks/serve_prefix_routing.py).

A decision is data (`Route`): which replica, how many of the prompt's blocks it is thought to hold, and why.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from plait.serve.engine.scheduler import block_keys

ROUTES = ("prefix", "least-loaded", "round-robin")
DEFAULT_KEYS = 4096  # keys kept per replica until its engine says how many blocks it has
MAX_IMBALANCE = 8  # sequences in flight beyond the least loaded replica's that a prefix hit may still add to


@dataclass(frozen=True)
class Route:
    replica: int
    matched: int  # leading full blocks of the prompt the router thinks that replica caches
    blocks: int  # full blocks of the prompt
    reason: str  # "prefix", "cold", "balance", "least-loaded", "round-robin"


class PrefixRouter:
    """Routes sequences over replicas by `policy` (one of ROUTES); `loads` are the sequences each runs now."""

    def __init__(self, block_size: int, policy: str = "prefix", max_imbalance: int = MAX_IMBALANCE):
        if policy not in ROUTES:
            raise ValueError(f"routing policy {policy!r} is not one of: {', '.join(ROUTES)}")
        self.block_size, self.policy, self.max_imbalance = block_size, policy, max_imbalance
        self.keys: dict[int, collections.OrderedDict[int, None]] = {}  # replica -> prefix keys sent there, LRU order
        self.capacity: dict[int, int] = {}  # replica -> its KV pool's blocks (the bound of its keys)
        self.routes: collections.deque[Route] = collections.deque(maxlen=1024)  # the latest decisions (tests, operators)
        self._turn = itertools.count()

    def choose(self, prompt: Sequence[int], salt: object, loads: Mapping[int, int]) -> Route:
        """The replica for a prompt among `loads` (replica -> sequences in flight there); remembers the prompt's keys
        there. `salt`: the engine's for this prompt (a LoRA adapter's index, else None)."""
        assert loads, "choose() needs at least one replica"
        keys = block_keys(list(prompt), self.block_size, salt=salt) if self.policy == "prefix" else []
        route = self._decide(keys, loads)
        self.routes.append(route)
        if keys:
            self._remember(route.replica, keys)
        return route

    def _decide(self, keys: list[int], loads: Mapping[int, int]) -> Route:
        if self.policy == "round-robin":
            order = sorted(loads)
            return Route(order[next(self._turn) % len(order)], 0, 0, "round-robin")
        if self.policy == "least-loaded":  # ties in turn (nginx's least_conn), so that one replica is not always first
            low = min(loads.values())
            tied = sorted(i for i in loads if loads[i] == low)
            return Route(tied[next(self._turn) % len(tied)], 0, 0, "least-loaded")
        matched = {i: self.matched(i, keys) for i in loads}
        least = min(loads, key=lambda i: (loads[i], len(self.keys.get(i, ())), i))
        best = min(loads, key=lambda i: (-matched[i], loads[i], len(self.keys.get(i, ())), i))
        if matched[best] == 0:
            return Route(least, 0, len(keys), "cold")
        if loads[best] - loads[least] > self.max_imbalance:
            return Route(least, matched[least], len(keys), "balance")
        return Route(best, matched[best], len(keys), "prefix")

    def matched(self, replica: int, keys: list[int]) -> int:
        """How many of `keys`, from the first, the replica was sent (and has not evicted by the router's count)."""
        held = self.keys.get(replica, {})
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n

    def _remember(self, replica: int, keys: list[int]) -> None:
        held = self.keys.setdefault(replica, collections.OrderedDict())
        for key in keys:
            held[key] = None
            held.move_to_end(key)
        bound = self.capacity.get(replica, DEFAULT_KEYS)
        while len(held) > bound:
            held.popitem(last=False)

    def set_capacity(self, replica: int, blocks: int) -> None:
        """The replica's KV pool holds `blocks` blocks: it cannot cache more keys than that."""
        self.capacity[replica] = max(1, blocks)
        if replica in self.keys:
            self._remember(replica, [])

    def forget(self, replica: int) -> None:
        """The replica's cache is gone (it died; its replacement starts empty)."""
        self.keys.pop(replica, None)
        self.capacity.pop(replica, None)
