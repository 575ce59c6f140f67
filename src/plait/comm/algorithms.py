"""Collective algorithms from the textbooks, written on point-to-point sends and receives.

    ring_all_reduce(t)                     # reduce-scatter + all-gather around a ring
    tree_all_reduce(t)                     # recursive halving (reduce-scatter) + doubling (all-gather)
    hierarchical_all_reduce(t, local_size) # within each node, across node leaders, back within the node

Each sums `t` in place over the ranks of `group` (or over an explicit list of global `ranks`),
the same result as `dist.all_reduce(t)` up to the order of floating-point additions, for any
number of ranks and any tensor size (chunks may be uneven or empty).

* Ring (Patarasuk & Yuan 2009; the ring of Thakur, Rabenseifner & Gropp 2005): the tensor is cut
  into n chunks; n-1 steps of reduce-scatter leave rank r with chunk r summed, n-1 steps of
  all-gather spread the sums. Each rank sends 2 (n-1)/n of the tensor: bandwidth-optimal, but
  2 (n-1) latency terms.
* Recursive halving-doubling (Rabenseifner 2004; Thakur et al. 2005): log2 p exchange steps with
  partners at distance p/2, p/4, ..., 1 halve the segment each rank is responsible for, then the
  reverse doubles it back: the same 2 (n-1)/n volume in 2 log2 p latency terms. With n not a power
  of two, the first 2 (n - p) ranks pair up first (even ranks hand their vector to the odd one and
  get the result back at the end), as in MPICH. Where that leaves p = 2 (2 or 3 ranks), the two ranks
  swap whole vectors and add instead (recursive doubling): the same bytes in one step instead of two.
* Hierarchical (the two-level scheme of NCCL and Horovod): ranks are grouped into nodes of
  `local_size` consecutive ranks; members send their vectors to the node's first rank, the leaders
  run a ring all-reduce among themselves, then each leader sends the result back to its members,
  so only one rank per node touches the slow network.

Also here: ring reduce-scatter and all-gather (the two halves of the ring), and a binomial-tree
broadcast. Sends go through torch.distributed's Python isend/irecv, so plait.comm.accounting
counts them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_ranks(group=None) -> list[int]:
    """Global ranks of `group` (the default group when None), in group-rank order."""
    if group is None:
        return list(range(dist.get_world_size()))
    return [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]


def _exchange(send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int) -> None:
    """Send `send` to global rank dst while receiving `recv` from src (either may be None or empty).

    Both in segments (_segments), as every transfer here is: a vector of a given size travels in the
    same pieces whichever function sends or receives it.
    """
    reqs = []
    if recv is not None:
        reqs += [dist.irecv(recv[a:b], src) for a, b in _segments(recv.numel(), recv.element_size())]
    if send is not None:
        reqs += [dist.isend(send[a:b], dst) for a, b in _segments(send.numel(), send.element_size())]
    for req in reqs:
        req.wait()


# Receives are cut into segments of this many bytes: the add of one segment overlaps the receipt of the next
# (gloo's TCP transport reads on its own thread), as gloo's and NCCL's own ring pipelines do.
SEGMENT_BYTES = 1 << 20
_scratch_cache: dict[tuple, torch.Tensor] = {}  # (dtype, device) -> the receive buffer, grown as needed


def _scratch(like: torch.Tensor, numel: int) -> torch.Tensor:
    """A receive buffer of `numel` elements, reused across calls (a fresh one page-faults on every call)."""
    key = (like.dtype, like.device)
    buf = _scratch_cache.get(key)
    if buf is None or buf.numel() < numel:
        buf = _scratch_cache[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel]


def release_scratch() -> None:
    """Free the cached receive buffers."""
    _scratch_cache.clear()


def _segments(numel: int, elem_bytes: int) -> list[tuple[int, int]]:
    """[(start, stop)] cutting numel elements into segments of about SEGMENT_BYTES (the same cut on every rank)."""
    step = max(1, SEGMENT_BYTES // elem_bytes)
    return [(a, min(a + step, numel)) for a in range(0, numel, step)]


def _reduce_exchange(send: torch.Tensor | None, dst: int, keep: torch.Tensor, src: int) -> None:
    """Send `send` to dst while receiving a vector the size of `keep` from src and adding it into `keep`.

    Both go in segments: every receive is posted first, then every send; each segment is added as soon as
    it has arrived, while the transport's thread reads the next one.
    """
    if not keep.numel():
        _exchange(send, dst, None, src)
        return
    buf = _scratch(keep, keep.numel())
    cut = _segments(keep.numel(), keep.element_size())
    recvs = [dist.irecv(buf[a:b], src) for a, b in cut]
    sends = [] if send is None else [dist.isend(send[a:b], dst) for a, b in _segments(send.numel(), send.element_size())]
    for (a, b), req in zip(cut, recvs):
        req.wait()
        keep[a:b].add_(buf[a:b])
    for req in sends:
        req.wait()


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()


def _writeback(tensor: torch.Tensor, flat: torch.Tensor) -> None:
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(flat.view_as(tensor))


def _me(ranks: list[int]) -> int:
    me = dist.get_rank()
    if me not in ranks:
        raise ValueError(f"rank {me} is not among the ranks of this collective {ranks}")
    return ranks.index(me)


# ----------------------------------------------------------------------------- ring


def ring_reduce_scatter_chunks(chunks: list[torch.Tensor], ranks: list[int]) -> None:
    """Sum chunk i over the ring into position i on ranks[i] (other chunks are left partial)."""
    n, i = len(ranks), _me(ranks)
    right, left = ranks[(i + 1) % n], ranks[(i - 1) % n]
    for s in range(n - 1):
        _reduce_exchange(chunks[(i - s - 1) % n], right, chunks[(i - s - 2) % n], left)


def ring_all_gather_chunks(chunks: list[torch.Tensor], ranks: list[int]) -> None:
    """ranks[i] holds chunk i; afterwards every rank holds every chunk."""
    n, i = len(ranks), _me(ranks)
    right, left = ranks[(i + 1) % n], ranks[(i - 1) % n]
    for s in range(n - 1):
        _exchange(chunks[(i - s) % n], right, chunks[(i - s - 1) % n], left)


def ring_all_reduce(tensor: torch.Tensor, group=None, ranks: list[int] | None = None) -> torch.Tensor:
    """Sum `tensor` in place over the ranks: ring reduce-scatter then ring all-gather."""
    ranks = ranks if ranks is not None else group_ranks(group)
    if len(ranks) == 1:
        return tensor
    flat = _flat(tensor)
    _pipelined_ring(list(torch.tensor_split(flat, len(ranks))), ranks)
    _writeback(tensor, flat)
    return tensor


def _pipelined_ring(chunks: list[torch.Tensor], ranks: list[int]) -> None:
    """The ring's 2 (n-1) steps as one pipeline of segments, every receive posted up front.

    A receive posted late costs a round trip (gloo's transport sends only into a posted receive) and a
    wake-up on a busy machine, per step; posted at the start, each arrives while this rank works on
    the previous one. A segment goes on to the right neighbour as soon as it is summed (or, in the
    all-gather, received), so the steps overlap too. Receiving into a chunk this rank is still sending
    is safe: the sum of a chunk cannot come back before the whole ring has read this rank's share.
    """
    n, i = len(ranks), _me(ranks)
    right, left = ranks[(i + 1) % n], ranks[(i - 1) % n]
    es = chunks[0].element_size()
    cuts = [_segments(c.numel(), es) for c in chunks]
    # reduce-scatter step s receives chunk (i-s-2) % n into its own stretch of scratch, then adds it
    total = sum(chunks[(i - s - 2) % n].numel() for s in range(n - 1))
    scratch = _scratch(chunks[0], total) if total else None
    rs, off = [], 0
    for s in range(n - 1):
        c = (i - s - 2) % n
        buf = scratch[off:off + chunks[c].numel()] if total else None
        off += chunks[c].numel()
        rs.append([(chunks[c][a:b], buf[a:b], dist.irecv(buf[a:b], left)) for a, b in cuts[c]])
    # all-gather step s receives chunk (i-s-1) % n straight into place
    ag = [[(chunks[c][a:b], dist.irecv(chunks[c][a:b], left)) for a, b in cuts[c]]
          for c in ((i - s - 1) % n for s in range(n - 1))]
    first = (i - 1) % n
    sends = [dist.isend(chunks[first][a:b], right) for a, b in cuts[first]]
    for step in rs:
        for dst, buf, req in step:
            req.wait()
            dst.add_(buf)
            sends.append(dist.isend(dst, right))  # the next step's share; after the last, chunk i: the all-gather's
    for step in ag[:-1]:
        for dst, req in step:
            req.wait()
            sends.append(dist.isend(dst, right))
    for _, req in ag[-1]:
        req.wait()
    for req in sends:
        req.wait()


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None) -> torch.Tensor:
    """Like dist.reduce_scatter_single: `output` gets this rank's 1/n of the sum of `input` over the ranks."""
    ranks = group_ranks(group)
    n, i = len(ranks), _me(ranks)
    if input.numel() != n * output.numel():
        raise ValueError(f"input has {input.numel()} elements, expected {n} x output ({output.numel()})")
    work = input.reshape(-1).clone()
    chunks = list(work.chunk(n))
    ring_reduce_scatter_chunks(chunks, ranks)
    output.view(-1).copy_(chunks[i])
    return output


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group=None) -> torch.Tensor:
    """Like dist.all_gather_single: `output` is every rank's `input`, concatenated in rank order."""
    ranks = group_ranks(group)
    n, i = len(ranks), _me(ranks)
    if output.numel() != n * input.numel():
        raise ValueError(f"output has {output.numel()} elements, expected {n} x input ({input.numel()})")
    flat = output.view(-1)
    chunks = list(flat.chunk(n))
    chunks[i].copy_(input.reshape(-1))
    ring_all_gather_chunks(chunks, ranks)
    return output


# ----------------------------------------------------------------------------- halving-doubling


def _irecvs(t: torch.Tensor, src: int) -> list:
    return [(a, b, dist.irecv(t[a:b], src)) for a, b in _segments(t.numel(), t.element_size())]


def _isends(t: torch.Tensor, dst: int) -> list:
    return [dist.isend(t[a:b], dst) for a, b in _segments(t.numel(), t.element_size())]


def _add_as_they_come(dst: torch.Tensor, buf: torch.Tensor, recvs: list) -> None:
    for a, b, req in recvs:
        req.wait()
        dst[a:b].add_(buf[a:b])


def tree_all_reduce(tensor: torch.Tensor, group=None, ranks: list[int] | None = None) -> torch.Tensor:
    """Sum `tensor` in place: recursive halving reduce-scatter, then recursive doubling all-gather.

    Every receive is posted up front, as in the ring (_pipelined_ring): the halving's into scratch, the
    doubling's straight into the half this rank gave away (its partner sends it back only after reading it).
    """
    ranks = ranks if ranks is not None else group_ranks(group)
    n, i = len(ranks), _me(ranks)
    if n == 1:
        return tensor
    flat = _flat(tensor)
    p = 1 << (n.bit_length() - 1)  # largest power of two <= n
    rem = n - p
    # Fold: among the first 2*rem ranks, even ones give their vector to their odd neighbour.
    if i < 2 * rem and i % 2 == 0:
        back = _irecvs(flat, ranks[i + 1])  # the result comes back at the end
        sends = _isends(flat, ranks[i + 1])
        for *_, req in back + [(0, 0, r) for r in sends]:
            req.wait()
        _writeback(tensor, flat)
        return tensor
    folded = i < 2 * rem
    new = i // 2 if folded else i - rem

    def actual(newrank: int) -> int:
        return ranks[2 * newrank + 1] if newrank < rem else ranks[newrank + rem]

    if p == 2:  # one halving and one doubling send what one swap of the whole vector sends: swap instead
        _swap_and_add(flat, actual(new ^ 1), fold_from=ranks[i - 1] if folded else None)
        if folded:
            _exchange(flat, ranks[i - 1], None, -1)  # the sum back to the even rank folded in
        _writeback(tensor, flat)
        return tensor
    base, extra = divmod(flat.numel(), p)  # chunk c has base + (c < extra) elements, as tensor_split cuts
    bounds = [c * base + min(c, extra) for c in range(p + 1)]
    lo, hi = 0, p  # the chunk range this rank is responsible for
    steps = []  # (partner, kept slice, given slice)
    mask = p >> 1
    while mask:
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if not new & mask else ((mid, hi), (lo, mid))
        steps.append((actual(new ^ mask), flat[bounds[keep[0]]:bounds[keep[1]]], flat[bounds[give[0]]:bounds[give[1]]]))
        lo, hi = keep
        mask >>= 1
    scratch = _scratch(flat, (flat.numel() if folded else 0) + sum(k.numel() for _, k, _ in steps))
    off, fold_in = 0, None
    if folded:
        fold_in = _irecvs(scratch[:flat.numel()], ranks[i - 1])
        off = flat.numel()
    halving = []
    for partner, kept, _ in steps:
        halving.append((scratch[off:off + kept.numel()], _irecvs(scratch[off:off + kept.numel()], partner)))
        off += kept.numel()
    doubling = [_irecvs(given, partner) for partner, _, given in steps]
    sends = []
    if folded:
        _add_as_they_come(flat, scratch, fold_in)
    for (partner, kept, given), (buf, recvs) in zip(steps, halving):
        sends += _isends(given, partner)
        _add_as_they_come(kept, buf, recvs)
    for (partner, kept, _), recvs in zip(reversed(steps), reversed(doubling)):  # swap the summed halves back
        sends += _isends(kept, partner)
        for *_, req in recvs:
            req.wait()
    if folded:  # an odd rank of the fold returns the result to its even neighbour
        sends += _isends(flat, ranks[i - 1])
    for req in sends:
        req.wait()
    _writeback(tensor, flat)
    return tensor


def _swap_and_add(flat: torch.Tensor, partner: int, fold_from: int | None = None) -> None:
    """Recursive doubling on two ranks: send the whole vector to the partner while receiving its, then add.

    The same bytes as a halving step and a doubling step (the whole vector), in one exchange instead of
    two: half the round trips and wake-ups, which is what a 1 MB all-reduce costs on a shared CPU. Both
    ranks compute a + b (IEEE addition commutes), so they agree bit for bit. A segment is added only once
    this rank's own send of it has completed: the send reads the memory the add writes. With fold_from,
    the vector of the even rank folded into this one is received and added first.
    """
    n = flat.numel()
    scratch = _scratch(flat, 2 * n if fold_from is not None else n)
    fold_in = _irecvs(scratch[:n], fold_from) if fold_from is not None else []
    buf = scratch[len(scratch) - n:]
    recvs = _irecvs(buf, partner)  # posted before the fold-in is summed: every receive up front
    _add_as_they_come(flat, scratch[:n], fold_in)
    sends = _isends(flat, partner)
    for (a, b, req), sent in zip(recvs, sends):
        req.wait()
        sent.wait()
        flat[a:b].add_(buf[a:b])


def tree_broadcast(tensor: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """Binomial-tree broadcast from global rank src: log2 n rounds, each holder sends to one new rank."""
    ranks = group_ranks(group)
    n, i = len(ranks), _me(ranks)
    root = ranks.index(src)
    rel = (i - root) % n
    flat = _flat(tensor)
    mask = 1
    while mask < n:  # receive from the rank that is `mask` below in relative order
        if rel & mask:
            _exchange(None, -1, flat, ranks[(rel - mask + root) % n])
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if rel + mask < n:
            _exchange(flat, ranks[(rel + mask + root) % n], None, -1)
        mask >>= 1
    _writeback(tensor, flat)
    return tensor


# ----------------------------------------------------------------------------- hierarchical


def hierarchical_all_reduce(tensor: torch.Tensor, local_size: int, group=None) -> torch.Tensor:
    """Sum in place in two levels: into each node's first rank, a ring among those leaders, back out.

    local_size: ranks per node (consecutive ranks share a node; the last node may have fewer).
    """
    ranks = group_ranks(group)
    n, i = len(ranks), _me(ranks)
    if local_size < 1:
        raise ValueError(f"local_size = {local_size} must be >= 1")
    node, local = divmod(i, local_size)
    members = ranks[node * local_size:min(n, (node + 1) * local_size)]
    leaders = ranks[::local_size]
    flat = _flat(tensor)
    if local:
        _exchange(flat, members[0], None, -1)
        _exchange(None, -1, flat, members[0])
        _writeback(tensor, flat)
        return tensor
    for m in members[1:]:
        _reduce_exchange(None, -1, flat, m)
    ring_all_reduce(flat, ranks=leaders)
    for m in members[1:]:
        _exchange(flat, m, None, -1)
    _writeback(tensor, flat)
    return tensor


ALL_REDUCE = {"ring": ring_all_reduce, "tree": tree_all_reduce}
ALGORITHMS = ("native", "ring", "tree", "hierarchical")  # parallel.allreduce's choices


def all_reduce(tensor: torch.Tensor, algo: str, group=None, local_size: int = 1) -> torch.Tensor:
    """Sum `tensor` in place over `group` with the named algorithm ("native": dist.all_reduce)."""
    if algo == "native":
        dist.all_reduce(tensor, group=group)
    elif algo == "hierarchical":
        hierarchical_all_reduce(tensor, local_size, group)
    elif algo in ALL_REDUCE:
        ALL_REDUCE[algo](tensor, group)
    else:
        raise ValueError(f"unknown all-reduce algorithm {algo!r}; choose from {', '.join(ALGORITHMS)}")
    return tensor


def bytes_sent(algo: str, numel: int, n: int, i: int, elem_bytes: int = 4, local_size: int = 1) -> int:
    """Bytes rank i of n sends in one all-reduce of `numel` elements (the chunks cut as the algorithm cuts them).

    ring: every chunk but its own in the reduce-scatter, every chunk but its right neighbour's in the all-gather
    (2 (n-1)/n of the tensor when n divides it). tree: 2 (p-1)/p of it on the p = 2^k ranks of the
    halving-doubling, the whole tensor once for a rank folded in or out (n not a power of two).
    hierarchical: a member sends the tensor to its node's first rank; that leader runs the ring among the
    leaders and sends the sum to each of its members.
    """
    if n == 1:
        return 0
    if algo == "native":  # gloo's and NCCL's ring, as plait.comm.accounting counts every all_reduce
        return int(2 * (n - 1) / n * numel * elem_bytes)
    if algo == "ring":
        sizes = [c.numel() for c in torch.tensor_split(torch.empty(numel, device="meta"), n)]
        return (2 * numel - sizes[i] - sizes[(i + 1) % n]) * elem_bytes
    if algo == "hierarchical":
        node, local = divmod(i, local_size)
        if local:
            return numel * elem_bytes
        members = min(n, (node + 1) * local_size) - node * local_size
        leaders = -(-n // local_size)
        return (members - 1) * numel * elem_bytes + bytes_sent("ring", numel, leaders, node, elem_bytes)
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    if i < 2 * rem and i % 2 == 0:
        return numel * elem_bytes  # folded in: hands over its vector, gets the sum back
    new = i // 2 if i < 2 * rem else i - rem
    base, extra = divmod(numel, p)
    size = [base + (c < extra) for c in range(p)]
    sent, lo, hi, mask = 0, 0, p, p >> 1
    while mask:  # halving sends the half it gives away; doubling sends back the half it kept, as much again
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if not new & mask else ((mid, hi), (lo, mid))
        sent += sum(size[give[0]:give[1]]) + sum(size[keep[0]:keep[1]])
        lo, hi = keep
        mask >>= 1
    return (sent + (numel if i < 2 * rem else 0)) * elem_bytes
