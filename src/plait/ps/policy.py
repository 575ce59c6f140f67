"""The parameter server's decisions as plain data: who owns which parameter, and who may run ahead.

    shards = assign_shards({"fc.weight": 8192, "fc.bias": 64, ...}, servers=2)   # [[names of ps0], [names of ps1]]
    policy = StalenessPolicy("ssp", bound=2)
    policy.may_proceed(clock=5, clocks=[5, 3])   # True: 5 - 3 <= 2

* Sharding (Li et al. 2014, "Scaling Distributed Machine Learning with the Parameter Server"):
  dedicated servers hold whole tensors, placed largest first on the server with the fewest bytes so
  far (the LPT rule), so the servers' loads are balanced by bytes and every rank computes the same map.
  Colocated servers (BytePS, Jiang et al. 2020, which partitions tensors too) hold row blocks: server
  k of n takes rows [k r / n, (k+1) r / n) of every tensor of r rows, so each serves 1/n of the bytes
  (exactly, when n divides the rows) and a worker keeps its own 1/n off the network.
  A shard is a list of pieces (name, first row, end row); (name, None, None) is the whole tensor.
* Staleness (Ho et al. 2013, "More Effective Distributed ML via a Stale Synchronous Parallel
  Parameter Server"): a worker's clock is the number of updates it has pushed. Under SSP with bound
  s, a worker at clock c may compute its next gradient only when every live worker has reached
  c - s; s = 0 is lockstep, async never waits (Hogwild / Downpour SGD). Workers that finished or died
  no longer hold the others back.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.comm.placement import balanced_owners

Piece = tuple[str, int | None, int | None]  # (parameter name, first row, end row); rows None: the whole tensor


def piece_key(piece: Piece) -> str:
    """The name a piece travels under: the parameter's, or name[lo:hi] for a row block."""
    name, lo, hi = piece
    return name if lo is None else f"{name}[{lo}:{hi}]"


def whole(shards: list[list[str]]) -> list[list[Piece]]:
    """Shards of whole tensors, as pieces."""
    return [[(n, None, None) for n in names] for names in shards]


def split_rows(rows: dict[str, int], servers: int) -> list[list[Piece]]:
    """Row blocks of every tensor, block k on server k (rows 0 for a 0-d tensor: whole, on server 0); model order."""
    out: list[list[Piece]] = [[] for _ in range(servers)]
    for name, r in rows.items():
        if r == 0:
            out[0].append((name, None, None))
            continue
        for k in range(servers):
            lo, hi = k * r // servers, (k + 1) * r // servers
            if hi > lo:
                out[k].append((name, lo, hi))
    return out


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
