"""Mismatched collectives, caught before they hang: every collective is fingerprinted and compared across ranks.

With launch.check_collectives each rank, before it enters a collective, posts
(sequence number in its group, op, tensor shape and dtype, where it was called) to the job's
key-value store and reads the fingerprints of the other ranks of the group for the same
sequence number. A difference is an error that names the ranks, both operations and both call
sites, instead of a hang or a garbled result. (torch's TORCH_DISTRIBUTED_DEBUG=DETAIL does the
comparison too, but crashes DDP on CPU in torch 2.13.)
"""

from __future__ import annotations

import json
import threading

import torch
import torch.distributed as dist

WAIT_S = 60.0  # how long to wait for the other ranks' fingerprints before letting the collective decide
POLL_S = 2.0  # after this long, look at what the missing ranks are waiting in


class CollectiveMismatch(RuntimeError):
    pass


class Fingerprinter:
    def __init__(self, store, rank: int):
        self.store, self.rank = store, rank
        self.seq: dict[str, int] = {}
        self.lock = threading.Lock()

    def check(self, op: str, tensor, group, site: str) -> None:
        name = group.group_name if group is not None else "default"
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        with self.lock:
            seq = self.seq[name] = self.seq.get(name, 0) + 1
        t = tensor[0] if isinstance(tensor, (list, tuple)) and tensor else tensor
        mine = {"op": op, "shape": list(t.shape) if isinstance(t, torch.Tensor) else None,
                "dtype": str(t.dtype).replace("torch.", "") if isinstance(t, torch.Tensor) else None, "site": site}
        key = f"plait/fp/{name}/{seq}"
        self.store.set(f"{key}/{self.rank}", json.dumps(mine))
        self.store.set(f"plait/fp/waiting/{self.rank}", json.dumps({**mine, "group": name, "call": seq}))
        others = [r for r in ranks if r != self.rank]
        waited = 0.0
        while True:
            try:
                self.store.wait([f"{key}/{r}" for r in others], _timedelta(POLL_S))
                break
            except RuntimeError:
                waited += POLL_S
                self._waits_for(others, key, name, seq, mine)
                if waited >= WAIT_S:
                    return  # a rank never got here: a hang, which the collective's timeout reports
        for r in others:
            theirs = json.loads(self.store.get(f"{key}/{r}"))
            if (theirs["op"], theirs["shape"], theirs["dtype"]) != (mine["op"], mine["shape"], mine["dtype"]):
                lo, hi = sorted([(self.rank, mine), (r, theirs)], key=lambda x: x[0])
                raise CollectiveMismatch(
                    f"ranks issued different collectives (call {seq} on group {name}): "
                    + "; ".join(f"rank {k} runs {fp['op']} of {fp['dtype']} shape {fp['shape']} (called at {fp['site']})"
                                for k, fp in (lo, hi))
                )


    def _waits_for(self, others: list[int], key: str, name: str, seq: int, mine: dict) -> None:
        """A peer that has not posted this call but waits in a collective of another group: that is the mismatch."""
        for r in others:
            if self.store.check([f"{key}/{r}"]) or not self.store.check([f"plait/fp/waiting/{r}"]):
                continue
            theirs = json.loads(self.store.get(f"plait/fp/waiting/{r}"))
            if theirs["group"] != name:
                pair = sorted([(self.rank, {**mine, "group": name, "call": seq}), (r, theirs)], key=lambda x: x[0])
                raise CollectiveMismatch(
                    "ranks wait in different collectives: " + "; ".join(
                        f"rank {k} runs {fp['op']} of {fp['dtype']} shape {fp['shape']} on group {fp['group']} "
                        f"(call {fp['call']}, called at {fp['site']})" for k, fp in pair))


def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)
