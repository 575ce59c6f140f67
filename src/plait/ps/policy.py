"""The parameter server's decisions as plain data: who owns which parameter, and who may run ahead.

    shards = assign_shards({"fc.weight": 8192, "fc.bias": 64, ...}, servers=2)   # [[names of ps0], [names of ps1]]
    policy = StalenessPolicy("ssp", bound=2)
    policy.may_proceed(clock=5, clocks=[5, 3])   # True: 5 - 3 <= 2

* Sharding (Li et al. 2014, "Scaling Distributed Machine Learning with the Parameter Server"):
  parameters are whole tensors, placed largest first on the server with the fewest bytes so far
  (the LPT rule), so the servers' loads are balanced by bytes and every rank computes the same map.
* Staleness (Ho et al. 2013, "More Effective Distributed ML via a Stale Synchronous Parallel
  Parameter Server"): a worker's clock is the number of updates it has pushed. Under SSP with bound
  s, a worker at clock c may compute its next gradient only when every live worker has reached
  c - s; s = 0 is lockstep, async never waits (Hogwild / Downpour SGD). Workers that finished or died
  no longer hold the others back.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.comm.placement import balanced_owners


def assign_shards(sizes: dict[str, int], servers: int) -> list[list[str]]:
    """Parameter names per server, balanced by bytes (largest first onto the lightest server); model order within each."""
    names = list(sizes)
    owner = balanced_owners([sizes[n] for n in names], servers)
    return [[n for n, o in zip(names, owner) if o == k] for k in range(servers)]


@dataclass(frozen=True)
class StalenessPolicy:
    """When a worker may go on (parallel.ps_mode = async or ssp; sync rounds are handled by the server)."""

    mode: str
    bound: int = 0

    def may_proceed(self, clock: int, clocks: list[int]) -> bool:
        """Whether a worker that has pushed `clock` updates may compute its next one, given the live workers' clocks."""
        if self.mode == "async" or not clocks:
            return True
        return clock - min(clocks) <= self.bound


def staleness_summary(values: list[int]) -> dict:
    """Mean, max and histogram of the staleness of a window's updates (for metrics.jsonl)."""
    if not values:
        return {}
    hist: dict[str, int] = {}
    for v in values:
        hist[str(v)] = hist.get(str(v), 0) + 1
    return {"staleness_mean": sum(values) / len(values), "staleness_max": max(values), "staleness_updates": len(values),
            "staleness_hist": dict(sorted(hist.items(), key=lambda kv: int(kv[0])))}
