"""The replicas' router (plait.serve.fleet.router), alone: its decisions as data on made-up prompts and loads."""

import pytest

from plait.serve.engine.scheduler import BlockPool, Scheduler, block_keys
from plait.serve.fleet.router import PrefixRouter, Route

BS = 4
SYSTEM_A = list(range(100, 116))  # 4 full blocks
SYSTEM_B = list(range(200, 216))


def test_a_prompt_goes_where_its_longest_prefix_was_sent():
    r = PrefixRouter(BS)
    assert r.choose(SYSTEM_A + [1, 2], None, {0: 0, 1: 0}) == Route(0, 0, 4, "cold")
    assert r.choose(SYSTEM_B + [1, 2], None, {0: 0, 1: 0}) == Route(1, 0, 4, "cold")  # replica 0 holds more keys
    assert r.choose(SYSTEM_A + [3, 4, 5, 6, 7], None, {0: 3, 1: 0}) == Route(0, 4, 5, "prefix")  # busier, but cached
    assert r.choose(SYSTEM_B[:8] + [9] * 8, None, {0: 0, 1: 2}) == Route(1, 2, 4, "prefix")  # a shorter shared prefix
    assert r.choose([7] * 9, None, {0: 1, 1: 0}) == Route(1, 0, 2, "cold")  # nobody has it: the least loaded


def test_keys_are_the_engines_own_chain_with_its_salt():
    r = PrefixRouter(BS)
    r.choose(SYSTEM_A, None, {0: 0, 1: 0})
    assert list(r.keys[0]) == block_keys(SYSTEM_A, BS)
    # the same tokens for a LoRA adapter (salt 1) are other blocks in the engine: no prefix to follow
    assert r.choose(SYSTEM_A, 1, {0: 5, 1: 0}) == Route(1, 0, 4, "cold")
    # the engine registers the same chain for the blocks it computes: what the router remembers is what it caches
    pool = BlockPool(8, BS)
    s = Scheduler(pool, max_prefill_tokens=64)
    seq = s.add(SYSTEM_A + [1], 1)
    s.update(s.schedule(), {seq.id: 5})
    assert set(block_keys(SYSTEM_A, BS)) <= set(pool.block_of)


def test_a_cached_replica_far_busier_than_the_least_loaded_is_passed_over():
    r = PrefixRouter(BS, max_imbalance=2)
    r.choose(SYSTEM_A, None, {0: 0, 1: 0})
    assert r.choose(SYSTEM_A + [1], None, {0: 2, 1: 0}).replica == 0  # 2 more: still the cache
    assert r.choose(SYSTEM_A + [1], None, {0: 3, 1: 0}) == Route(1, 0, 4, "balance")


def test_memory_is_bounded_by_the_replicas_blocks_least_recently_sent_first():
    r = PrefixRouter(BS)
    r.set_capacity(0, 6)
    r.choose(SYSTEM_A, None, {0: 0})
    r.choose(SYSTEM_B, None, {0: 0})
    assert len(r.keys[0]) == 6
    assert r.matched(0, block_keys(SYSTEM_B, BS)) == 4 and r.matched(0, block_keys(SYSTEM_A, BS)) == 0
    r.forget(0)  # the replica died: its cache with it
    assert r.choose(SYSTEM_B, None, {0: 0, 1: 1}) == Route(0, 0, 4, "cold")


def test_the_baselines_spread_requests_whatever_they_share():
    ll = PrefixRouter(BS, "least-loaded")
    assert [ll.choose(SYSTEM_A, None, {0: 0, 1: 0}).replica for _ in range(4)] == [0, 1, 0, 1]  # ties in turn
    assert ll.choose(SYSTEM_A, None, {0: 3, 1: 1}).replica == 1
    rr = PrefixRouter(BS, "round-robin")
    assert [rr.choose(SYSTEM_A, None, {0: 9, 1: 0, 2: 0}).replica for _ in range(4)] == [0, 1, 2, 0]
    assert ll.keys == {} and rr.keys == {}  # neither keeps prefix keys
    with pytest.raises(ValueError, match="routing policy 'random' is not one of: prefix, least-loaded, round-robin"):
        PrefixRouter(BS, "random")
