"""Secure aggregation with pairwise additive masks: the server learns the sum of the updates and nothing else.

Bonawitz, Ivanov, Kreuter, Marcedone, McMahan, Patel, Ramage, Segal, Seth 2017, "Practical
Secure Aggregation for Privacy-Preserving Machine Learning" (CCS). Each pair of clients (i, j)
agrees on a secret seed by Diffie-Hellman over the 2048-bit MODP group of RFC 3526; for round r
both expand it into the same pseudo-random vector m_ij,r. Client i uploads

    y_i = x_i + sum_{j > i} m_ij - sum_{j < i} m_ij        (mod 2^64)

where x_i is its update in fixed point (FRAC_BITS fractional bits). Summed over all clients
the masks cancel exactly, so sum_i y_i = sum_i x_i; a single y_i is uniformly distributed and
independent of x_i (a one-time pad), which is what the tests check.

Dropouts: if client d is masked into the others' uploads but never uploads itself, its masks
do not cancel. The server then asks every survivor i for the round seed it shares with d and
removes sum m_id itself (`unmask`). A survivor that also fails to answer makes the round
fail: the global model is left unchanged and the next round starts fresh (documented
failure, never a wrong sum). Seeds are per round, so revealing one round's seed reveals nothing
about other rounds.

Threat model: honest-but-curious server and clients. This keeps the pairwise masks of the
paper but not its self-masks and Shamir shares, so a server that *lies* about which clients
dropped could unmask a client whose upload it already holds; clients refuse to reveal seeds
when fewer than `min_survivors` peers would remain, so a sum of one is never exposed.
Robust aggregation (per-update checks, median) is impossible on masked updates.

What bounds a hostile client instead (server.check_masked_total): each round announces a bound B
(federated.clip_norm, else federated.secure_clip_norm, or DP's clip norm); honest clients clip
their update to B and upload [w delta, w] with 1 <= w <= their sample count (w = 1 under DP).
The server sees only the sum, so no range check of one client's share exists (that would take
per-client range proofs, which this protocol does not have); it checks the sum: total weight W at
least one per client, at most the clients' known samples (exactly one per client under DP), and
|sum| <= W B. A round that fails is skipped with the reason and the model is kept, so one
client's negative weight or oversize update cannot blow the model up, nor leave honest clients
with a model they cannot encode in later rounds. The limit: a sum that passes still moves the
model by up to B (server_lr = 1), in any direction one hostile client picks, since its share can
cancel the others'; B is the most one round can do, so set it a few times an honest update's norm.
"""

from __future__ import annotations

import hashlib
import secrets

import numpy as np
import torch

# RFC 3526, group 14: 2048-bit MODP prime, generator 2.
P = int(
    "FFFFFFFFFFFFFFFFC90FDAA22168C234C4C6628B80DC1CD129024E088A67CC74020BBEA63B139B22514A08798E3404DDEF9519B3CD"
    "3A431B302B0A6DF25F14374FE1356D6D51C245E485B576625E7EC6F44C42E9A637ED6B0BFF5CB6F406B7EDEE386BFB5A899FA5AE9F24"
    "117C4B1FE649286651ECE45B3DC2007CB8A163BF0598DA48361C55D39A69163FA8FD24CF5F83655D23DCA3AD961C62F356208552BB9E"
    "D529077096966D670C354E4ABC9804F1746C08CA18217C32905E462E36CE3BE39E772C180E86039B2783A2EC07A28FB5C55DF06F4C52"
    "C9DE2BCBF6955817183995497CEA956AE515D2261898FA051015728E5A8AACAA68FFFFFFFFFFFFFFFF",
    16,
)
G = 2
SECRET_BITS = 256  # short exponents give ~128-bit security in this group (RFC 3526 section 8)
FRAC_BITS = 24  # fixed-point resolution 2^-24 ~ 6e-8
LIMIT = 2.0**62 / 2**FRAC_BITS  # |value| that still leaves headroom for sums without wrapping


def check_public_key(public: int) -> None:
    """The rule every client applies to a peer's key: 1 < key < P - 1 (no degenerate key 0, 1 or P - 1) and a member
    of the prime-order subgroup that G generates (key^q = 1 mod P, q = (P - 1) / 2: P is a safe prime), so no key
    confines the shared secret to a small subgroup. The server applies the same rule at registration, so a key it
    accepts never stops a client's agreement."""
    if isinstance(public, bool) or not isinstance(public, int) or not 1 < public < P - 1:
        raise ValueError("public key is outside the group (it must be an integer with 1 < key < P - 1)")
    if pow(public, (P - 1) // 2, P) != 1:
        raise ValueError("public key is not in the group's prime-order subgroup (key^((P-1)/2) mod P must be 1)")


def keypair() -> tuple[int, int]:
    """A fresh Diffie-Hellman (secret, public) pair."""
    secret = secrets.randbits(SECRET_BITS) | (1 << (SECRET_BITS - 1))
    return secret, pow(G, secret, P)


def agree(secret: int, peer_public: int) -> bytes:
    """The pair's shared key: SHA-256 of the DH shared value. Rejects degenerate public keys (check_public_key)."""
    check_public_key(peer_public)
    return hashlib.sha256(pow(peer_public, secret, P).to_bytes(256, "big")).digest()


def round_seed(shared: bytes, rnd: int) -> int:
    """The seed both ends of a pair use in round `rnd` (a fresh mask every round)."""
    return int.from_bytes(hashlib.sha256(shared + rnd.to_bytes(8, "big")).digest()[:16], "big")


def prg(seed: int, n: int) -> np.ndarray:
    """n pseudo-random uint64 values from a seed (PCG64)."""
    return np.random.Generator(np.random.PCG64(seed)).integers(0, 2**64, size=n, dtype=np.uint64, endpoint=False)


def encode(vec: torch.Tensor) -> np.ndarray:
    """Float vector -> fixed point in Z_2^64 (two's complement)."""
    v = vec.detach().to(torch.float64).cpu().numpy()
    if not np.isfinite(v).all() or np.abs(v).max(initial=0.0) >= LIMIT:
        raise ValueError(f"update values must be finite and below {LIMIT:.3g} in magnitude for secure aggregation")
    return np.round(v * 2.0**FRAC_BITS).astype(np.int64).view(np.uint64)


def decode(u: np.ndarray) -> torch.Tensor:
    """Fixed point in Z_2^64 -> float64 vector."""
    return torch.from_numpy(u.view(np.int64).astype(np.float64) / 2.0**FRAC_BITS)


def mask(encoded: np.ndarray, my_id: int, seeds: dict[int, int]) -> np.ndarray:
    """Add +m_ij for peers j > i and -m_ij for peers j < i (seeds: peer id -> this round's pair seed)."""
    out = encoded.copy()
    for j, s in seeds.items():
        m = prg(s, len(out))
        if my_id < j:
            out += m
        else:
            out -= m
    return out


def unmask(total: np.ndarray, recovered: dict[int, dict[int, int]]) -> np.ndarray:
    """Remove the masks survivors added for dropped peers: recovered[i][d] = round seed of pair (i, d)."""
    out = total.copy()
    for i, seeds in recovered.items():
        for d, s in seeds.items():
            m = prg(s, len(out))
            if i < d:
                out -= m
            else:
                out += m
    return out


class MaskingClient:
    """One client's side: its key pair, the keys it agreed with peers, masking and recovery answers."""

    def __init__(self, client_id: int):
        self.client_id = client_id
        self.secret, self.public = keypair()
        self._shared: dict[tuple[int, int], bytes] = {}

    def _seed(self, peer: int, peer_public: int, rnd: int) -> int:
        key = (peer, peer_public)
        if key not in self._shared:
            self._shared[key] = agree(self.secret, peer_public)
        return round_seed(self._shared[key], rnd)

    def masked(self, vec: torch.Tensor, rnd: int, peers: dict[int, int]) -> np.ndarray:
        """This round's upload: the encoded vector plus the pairwise masks with every other peer."""
        seeds = {j: self._seed(j, pk, rnd) for j, pk in peers.items() if j != self.client_id}
        return mask(encode(vec), self.client_id, seeds)

    def reveal(self, rnd: int, peers: dict[int, int], dropped: list[int], min_survivors: int) -> dict[int, int]:
        """The round seeds shared with dropped peers, so the server can remove their masks.

        Refused (ValueError) when fewer than `min_survivors` of the round's peers would remain,
        or when asked about a peer that was not in the round.
        """
        survivors = set(peers) - set(dropped)
        if len(survivors) < max(2, min_survivors) or self.client_id not in survivors:
            raise ValueError(f"refusing to unmask: only {len(survivors)} survivors would remain")
        if not set(dropped) <= set(peers):
            raise ValueError("asked to unmask a client that was not in the round")
        return {d: self._seed(d, peers[d], rnd) for d in dropped}


class MaskedSum:
    """The server's side for one round: the running masked sum, then recovery and decoding."""

    def __init__(self, participants: list[int], length: int):
        self.participants = sorted(participants)
        self.length = length
        self.total = np.zeros(length, dtype=np.uint64)
        self.received: list[int] = []
        self.recovered: dict[int, dict[int, int]] = {}

    def add(self, client_id: int, masked: np.ndarray) -> None:
        if client_id not in self.participants or client_id in self.received:
            raise ValueError(f"client {client_id} is not expected in this masked sum")
        if masked.dtype != np.uint64 or masked.shape != (self.length,):
            raise ValueError(f"masked update must be {self.length} uint64 values, got {masked.dtype} {masked.shape}")
        self.total += masked
        self.received.append(client_id)

    @property
    def dropped(self) -> list[int]:
        return [c for c in self.participants if c not in self.received]

    def recover(self, client_id: int, seeds: dict[int, int]) -> None:
        if client_id not in self.received or set(seeds) != set(self.dropped):
            raise ValueError(f"client {client_id}: recovery must give a seed for each dropped client {self.dropped}")
        self.recovered[client_id] = {int(d): int(s) for d, s in seeds.items()}

    @property
    def complete(self) -> bool:
        return not self.dropped or set(self.recovered) == set(self.received)

    def result(self) -> torch.Tensor:
        """The decoded sum of the survivors' vectors; raises if some survivor's recovery is missing."""
        if not self.complete:
            missing = sorted(set(self.received) - set(self.recovered))
            raise ValueError(f"secure aggregation failed: survivors {missing} did not reveal their seeds for {self.dropped}")
        return decode(unmask(self.total, self.recovered) if self.dropped else self.total)
