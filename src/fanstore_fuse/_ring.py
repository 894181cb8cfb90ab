"""Placement: a consistent-hash ring with virtual nodes and multi-probe lookups.

Every rank computes the same placement from nothing but the rank count, so no placement table is
ever exchanged. Two processes (or two releases) agree on an owner iff they agree on the constants
and key encodings below -- treat them as an on-disk/on-wire format and never change them silently.

Ring
    Each node ``n`` (a non-negative int) owns ``vnodes`` points on a 64-bit ring; virtual node ``i``
    of node ``n`` sits at ``xxh3_64(b"v:" + n.to_bytes(8, "little") + i.to_bytes(4, "little"),
    seed=RING_SEED)``. The points of a node depend only on the node id, never on the membership.

Lookup (multi-probe consistent hashing, Appleton & O'Reilly 2015)
    A key is hashed ``probes`` times: probe ``j`` is ``xxh3_64(key, seed=RING_SEED + j)`` (probe 0
    is the plain ``xxh3_64(key, seed=RING_SEED)``). Each probe finds its clockwise successor point
    (``bisect_left`` on the sorted points, wrapping past the top); the key belongs to the successor
    that is *nearest* to its probe (ties: lowest probe index). With one probe this is the classic
    ring. More probes cut the variance of a node's share of the hash space: a point's share
    saturates once its preceding arc is larger than ~1/(probes*points), so with ``probes`` = 8 a
    vnode's share has a coefficient of variation of ~0.26 instead of ~1.0, and 256 vnodes per node
    give the balance that ~4000 single-probe vnodes would (max/mean share ~1.06 at 4096 nodes).

    Movement is minimal: removing a node only removes its points, so a key's nearest successor is
    unchanged unless it was one of the removed points; adding a node only adds points, so a key
    moves only if it moves *to* the new node. Either way exactly the changing node's share moves.

Replicas
    ``owners(key, count)`` starts at the winning point and walks clockwise, collecting distinct
    nodes: the primary first, then the next distinct nodes on the ring.

Key encodings used by :class:`Placement`
    metadata of a dataset-relative path (bytes, ``b""`` for the root): ``b"m:" + path``
    data blob ``blob_id`` (0 <= blob_id < 2**64): ``b"d:" + blob_id.to_bytes(8, "little")``
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import xxhash

__all__ = [
    "DEFAULT_PROBES",
    "DEFAULT_VNODES",
    "RING_SEED",
    "Placement",
    "Ring",
    "data_key",
    "hash_shares",
    "metadata_key",
    "vnode_key",
]

#: Seed of every hash in the ring (vnode points use it; probe j uses RING_SEED + j). Fixed forever.
RING_SEED = 0x46414E5354524531  # b"FANSTRE1" as a big-endian integer
#: Virtual nodes per node.
DEFAULT_VNODES = 256
#: Hash probes per key lookup.
DEFAULT_PROBES = 8

_MASK = (1 << 64) - 1
_xxh3 = xxhash.xxh3_64_intdigest


def vnode_key(node: int, index: int) -> bytes:
    """The bytes hashed (with RING_SEED) to place virtual node ``index`` of ``node``."""
    return b"v:" + node.to_bytes(8, "little") + index.to_bytes(4, "little")


def metadata_key(path: bytes) -> bytes:
    """Ring key of the metadata record of a dataset-relative path (``b""`` is the root)."""
    return b"m:" + path


def data_key(blob_id: int) -> bytes:
    """Ring key of a data blob."""
    return b"d:" + blob_id.to_bytes(8, "little")


class Ring:
    """A consistent-hash ring over integer node ids with virtual nodes and multi-probe lookups.

    ``nodes`` may be in any order and must be distinct non-negative ints (< 2**64).
    """

    __slots__ = ("nodes", "vnodes", "probes", "_points", "_owner", "_seeds")

    def __init__(
        self, nodes: Sequence[int], vnodes: int = DEFAULT_VNODES, probes: int = DEFAULT_PROBES
    ) -> None:
        ns = sorted(int(n) for n in nodes)
        if not ns:
            raise ValueError("a ring needs at least one node")
        if len(set(ns)) != len(ns):
            raise ValueError("duplicate node ids")
        if ns[0] < 0:
            raise ValueError("node ids must be non-negative")
        if vnodes < 1 or probes < 1:
            raise ValueError("vnodes and probes must be >= 1")
        self.nodes: tuple[int, ...] = tuple(ns)
        self.vnodes = vnodes
        self.probes = probes
        h = _xxh3
        seed = RING_SEED
        idx = [i.to_bytes(4, "little") for i in range(vnodes)]
        pts: list[int] = []
        own: list[int] = []
        for n in ns:
            prefix = b"v:" + n.to_bytes(8, "little")
            pts.extend([h(prefix + b, seed) for b in idx])
            own.extend([n] * vnodes)
        # Sort by point; the stable sort over node-ordered input breaks equal points by node.
        order = sorted(range(len(pts)), key=pts.__getitem__)
        self._points: list[int] = [pts[i] for i in order]
        self._owner: list[int] = [own[i] for i in order]
        self._seeds: tuple[int, ...] = tuple(seed + j for j in range(probes))

    def __len__(self) -> int:
        return len(self.nodes)

    def __repr__(self) -> str:
        return f"Ring(nodes={len(self.nodes)}, vnodes={self.vnodes}, probes={self.probes})"

    def _point_index(self, key: bytes) -> int:
        """Index of the winning point: the successor nearest to any of the key's probes."""
        pts = self._points
        n = len(pts)
        h = _xxh3
        best_d = 1 << 64
        best_i = 0
        for seed in self._seeds:
            p = h(key, seed)
            i = bisect_left(pts, p)
            if i == n:
                i = 0
            d = (pts[i] - p) & _MASK
            if d < best_d:
                best_d = d
                best_i = i
        return best_i

    def owner(self, key: bytes) -> int:
        """The primary node of ``key``."""
        return self._owner[self._point_index(key)]

    def owners(self, key: bytes, count: int) -> list[int]:
        """``count`` distinct nodes for ``key`` (capped at the node count), primary first,
        the rest in clockwise ring order from the primary's winning point."""
        count = min(count, len(self.nodes))
        if count <= 0:
            return []
        own = self._owner
        n = len(own)
        i = self._point_index(key)
        out = [own[i]]
        if count == 1:
            return out
        seen = {out[0]}
        for step in range(1, n):
            o = own[(i + step) % n]
            if o not in seen:
                seen.add(o)
                out.append(o)
                if len(out) == count:
                    return out
        # Unreachable when every node has >= 1 point, kept as a guard.
        out.extend(x for x in self.nodes if x not in seen)
        return out[:count]

    # Introspection for simulations (bench/scale_model.py); not used on the hot path.
    def points(self) -> tuple[list[int], list[int]]:
        """The sorted ring points and their owner nodes (the live lists; do not mutate)."""
        return self._points, self._owner


class Placement:
    """Where metadata records and data blobs live among ``nranks`` ranks (0 .. nranks-1).

    ``replicas`` copies of each non-broadcast blob are kept on distinct ranks (capped at nranks);
    blobs for which ``is_broadcast(blob_id)`` is true are on every rank.
    """

    __slots__ = ("nranks", "replicas", "ring", "_is_broadcast")

    def __init__(
        self,
        nranks: int,
        replicas: int = 1,
        vnodes: int = DEFAULT_VNODES,
        is_broadcast: Callable[[int], bool] | None = None,
        probes: int = DEFAULT_PROBES,
    ) -> None:
        if nranks < 1:
            raise ValueError("nranks must be >= 1")
        if replicas < 1:
            raise ValueError("replicas must be >= 1")
        self.nranks = nranks
        self.replicas = min(replicas, nranks)
        self.ring = Ring(range(nranks), vnodes=vnodes, probes=probes)
        self._is_broadcast = is_broadcast

    def __repr__(self) -> str:
        return f"Placement(nranks={self.nranks}, replicas={self.replicas}, ring={self.ring!r})"

    def locate_metadata(self, path: bytes) -> int:
        """Rank owning the metadata record of dataset-relative ``path`` (``b""`` for the root)."""
        if self.nranks == 1:
            return 0
        return self.ring.owner(b"m:" + path)

    def locate_data(self, blob_id: int) -> list[int]:
        """Ranks holding ``blob_id``, primary first.

        ``replicas`` distinct ranks for a normal blob; every rank for a broadcast blob (the ring's
        primary first, then the others in rank order wrapping around from it).
        """
        n = self.nranks
        if self._is_broadcast is not None and self._is_broadcast(blob_id):
            if n == 1:
                return [0]
            p = self.ring.owner(b"d:" + blob_id.to_bytes(8, "little"))
            return [(p + i) % n for i in range(n)]
        if n == 1:
            return [0]
        key = b"d:" + blob_id.to_bytes(8, "little")
        if self.replicas == 1:
            return [self.ring.owner(key)]
        return self.ring.owners(key, self.replicas)

    def holds(self, rank: int, blob_id: int) -> bool:
        """Whether ``rank`` keeps a copy of ``blob_id``."""
        if not 0 <= rank < self.nranks:
            return False
        return rank in self.locate_data(blob_id)

    def iter_blobs_for_rank(self, rank: int, nblobs: int) -> Iterator[int]:
        """Blob ids in ``range(nblobs)`` that ``rank`` holds, ascending."""
        if not 0 <= rank < self.nranks:
            return
        bc = self._is_broadcast
        if self.nranks == 1:
            yield from range(nblobs)
            return
        ring = self.ring
        if self.replicas == 1:
            owner = ring.owner
            for b in range(nblobs):
                if (bc is not None and bc(b)) or owner(b"d:" + b.to_bytes(8, "little")) == rank:
                    yield b
            return
        owners = ring.owners
        r = self.replicas
        for b in range(nblobs):
            if (bc is not None and bc(b)) or rank in owners(b"d:" + b.to_bytes(8, "little"), r):
                yield b

    def blobs_for_rank(self, rank: int, nblobs: int) -> list[int]:
        """List form of :meth:`iter_blobs_for_rank`."""
        return list(self.iter_blobs_for_rank(rank, nblobs))


def hash_shares(ring: Ring) -> dict[int, float]:
    """Each node's exact share of the hash space under ``ring``'s lookup rule.

    Models the key hashes as independent uniform probes (the same idealisation under which a
    classic ring's share is its arc length). With ``k`` probes a point whose preceding arc is
    ``g`` wins a key with probability ``k * integral_0^g F(d)^(k-1) dd``, where ``F(d)`` is the
    fraction of the ring farther than ``d`` from the next point clockwise,
    ``F(d) = sum_q max(0, g_q - d)``.
    ``F`` is piecewise linear between sorted arc lengths, so the integral is a telescoping sum.
    Pure Python, O(P log P) for P points; used by the tests and the scale model.
    """
    pts, own = ring.points()
    m = len(pts)
    k = ring.probes
    scale = float(1 << 64)
    gaps = [((pts[i] - pts[i - 1]) & _MASK) / scale for i in range(m)]
    if m == 1:
        gaps = [1.0]
    order = sorted(range(m), key=gaps.__getitem__)
    # tail[i] = sum of sorted gaps from position i to the end.
    sg = [gaps[i] for i in order]
    tail = [0.0] * (m + 1)
    acc = 0.0
    for i in range(m - 1, -1, -1):
        acc += sg[i]
        tail[i] = acc
    share = [0.0] * m
    cum = 0.0
    prev = 0.0
    f_prev = tail[0]  # F(0) = 1 (up to rounding)
    for r in range(m):
        g = sg[r]
        c = m - r  # arcs longer than any d in (prev, g]
        f_g = tail[r] - c * g
        if c > 0 and g > prev:
            cum += (f_prev**k - f_g**k) / c
        share[order[r]] = cum
        prev = g
        f_prev = f_g
    out: dict[int, float] = {n: 0.0 for n in ring.nodes}
    for i in range(m):
        out[own[i]] += share[i]
    total = sum(out.values())
    return {n: v / total for n, v in out.items()}


class Locator(Protocol):
    """Where metadata and blobs live: `Placement` (the ring) or `LocalOnlyPlacement`."""

    nranks: int

    def locate_metadata(self, path: bytes) -> int: ...

    def locate_data(self, blob_id: int) -> list[int]: ...

    def holds(self, rank: int, blob_id: int) -> bool: ...

    def blobs_for_rank(self, rank: int, nblobs: int) -> list[int]: ...


class LocalOnlyPlacement:
    """Everything on rank 0 (after GekkoFS's `LocalOnlyDistributor`): one rank runs the same
    cluster code as N ranks, and every question it would ask a peer is answered locally."""

    nranks = 1

    def locate_metadata(self, path: bytes) -> int:
        return 0

    def locate_data(self, blob_id: int) -> list[int]:
        return [0]

    def holds(self, rank: int, blob_id: int) -> bool:
        return rank == 0

    def blobs_for_rank(self, rank: int, nblobs: int) -> list[int]:
        return list(range(nblobs)) if rank == 0 else []
