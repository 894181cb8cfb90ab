"""Unit tests of the placement ring (src/fanstore_fuse/_ring.py): pure Python, fast."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
try:
    from fanstore_fuse import _ring
except ImportError:  # package not installed: use the source tree
    sys.path.insert(0, str(SRC))
    from fanstore_fuse import _ring

Placement = _ring.Placement
Ring = _ring.Ring
hash_shares = _ring.hash_shares

PATHS = [b"", b"train", b"train/n01440764/n01440764_10026.JPEG", b"val/x.JPEG"]
BLOBS = [0, 1, 2, 3, 1 << 40]


def _blob_key(b: int) -> bytes:
    return b"d:" + b.to_bytes(8, "little")


def test_golden_placement() -> None:
    """Fixed expected owners: changing a constant or key encoding must fail loudly (it would make
    two releases disagree about where everything is)."""
    p = Placement(7, replicas=2)
    assert [p.locate_metadata(x) for x in PATHS] == [0, 6, 5, 1]
    assert [p.locate_data(b) for b in BLOBS] == [[0, 6], [6, 4], [0, 6], [6, 5], [0, 3]]
    assert _ring.metadata_key(b"a/b") == b"m:a/b"
    assert _ring.data_key(1) == b"d:\x01\x00\x00\x00\x00\x00\x00\x00"


def test_same_owners_in_another_process() -> None:
    code = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(SRC)!r})\n"
        "from fanstore_fuse._ring import Placement\n"
        "p = Placement(11, replicas=3)\n"
        "m = [p.locate_metadata(b'dir%d/file%d' % (i % 7, i)) for i in range(300)]\n"
        "d = [p.locate_data(i * 7919) for i in range(300)]\n"
        "print(json.dumps([m, d]))\n"
    )
    # A different hash seed in the child proves Python's hash() plays no part.
    env = {"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    ).stdout
    m, d = json.loads(out)
    p = Placement(11, replicas=3)
    assert m == [p.locate_metadata(b"dir%d/file%d" % (i % 7, i)) for i in range(300)]
    assert d == [p.locate_data(i * 7919) for i in range(300)]


def test_deterministic_and_order_independent() -> None:
    a = Ring([5, 1, 9, 3], vnodes=32)
    b = Ring([9, 3, 5, 1], vnodes=32)
    keys = [b"k%d" % i for i in range(2000)]
    assert [a.owner(k) for k in keys] == [b.owner(k) for k in keys]
    assert [a.owners(k, 3) for k in keys[:300]] == [b.owners(k, 3) for k in keys[:300]]
    assert Counter(a.owner(k) for k in keys).keys() == {1, 3, 5, 9}


def test_replicas_distinct_primary_first() -> None:
    r = Ring(range(10), vnodes=64)
    for i in range(500):
        k = b"x%d" % i
        o = r.owners(k, 3)
        assert len(o) == 3 and len(set(o)) == 3
        assert o[0] == r.owner(k)
        assert r.owners(k, 1) == [o[0]]
        assert r.owners(k, 2) == o[:2]
    p = Placement(6, replicas=2)
    for b in range(300):
        h = p.locate_data(b)
        assert len(set(h)) == 2 and h[0] == p.ring.owner(_blob_key(b))
        assert all(p.holds(x, b) for x in h)
        assert sum(p.holds(x, b) for x in range(6)) == 2


def test_broadcast() -> None:
    p = Placement(5, replicas=2, is_broadcast=lambda b: b % 10 == 0)
    for b in range(0, 100):
        h = p.locate_data(b)
        if b % 10 == 0:
            assert sorted(h) == list(range(5))
            assert h[0] == p.ring.owner(_blob_key(b))
            assert all(p.holds(x, b) for x in range(5))
        else:
            assert len(h) == 2
    held = {r: set(p.blobs_for_rank(r, 100)) for r in range(5)}
    for r in range(5):
        assert {0, 10, 20, 90} <= held[r]
    assert sum(len(s) for s in held.values()) == 10 * 5 + 90 * 2


def test_blobs_for_rank_matches_holds() -> None:
    for replicas in (1, 2):
        p = Placement(4, replicas=replicas)
        per = [p.blobs_for_rank(r, 400) for r in range(4)]
        assert sum(len(x) for x in per) == 400 * replicas
        for r in range(4):
            assert per[r] == [b for b in range(400) if p.holds(r, b)]
            assert per[r] == sorted(per[r])
    assert Placement(3).blobs_for_rank(7, 10) == []


def test_hash_space_balance_moderate_n() -> None:
    # Exact shares of the hash space (no key-sampling noise).
    for n in (8, 100):
        s = hash_shares(Ring(range(n)))
        assert abs(sum(s.values()) - 1.0) < 1e-9
        assert max(s.values()) * n <= 1.10
        assert min(s.values()) * n >= 0.90


def test_key_balance_and_shares_agree() -> None:
    n = 24
    p = Placement(n)
    nkeys = 120_000
    c = Counter(p.locate_data(b)[0] for b in range(nkeys))
    mean = nkeys / n
    assert max(c.values()) / mean <= 1.10
    shares = hash_shares(p.ring)
    # Counts follow the exact shares within sampling noise (sd ~ sqrt(5000) ~ 71 keys).
    for r in range(n):
        assert abs(c[r] - shares[r] * nkeys) < 5 * (mean**0.5)
    m = Counter(p.locate_metadata(b"train/c%03d/img%06d.JPEG" % (i % 100, i)) for i in range(nkeys))
    assert max(m.values()) / mean <= 1.10


@pytest.mark.parametrize("n", [2, 5, 40])
def test_movement_minimal_on_leave_and_join(n: int) -> None:
    keys = [b"m:f%d" % i for i in range(20_000)]
    base = Ring(range(n))
    own = [base.owner(k) for k in keys]
    # leave: only the leaver's keys move
    gone = n // 2
    left = Ring([x for x in range(n) if x != gone])
    own_l = [left.owner(k) for k in keys]
    moved = [i for i in range(len(keys)) if own[i] != own_l[i]]
    assert all(own[i] == gone for i in moved)
    assert len(moved) == own.count(gone)
    assert len(moved) / len(keys) <= 1 / n + 0.05
    # join: keys only move to the newcomer
    joined = Ring(range(n + 1))
    own_j = [joined.owner(k) for k in keys]
    moved = [i for i in range(len(keys)) if own[i] != own_j[i]]
    assert all(own_j[i] == n for i in moved)
    assert len(moved) / len(keys) <= 1 / (n + 1) + 0.05
    # a surviving primary keeps its key in its replica list too
    for k in keys[:500]:
        if base.owner(k) != gone:
            assert left.owners(k, 2)[0] == base.owners(k, 2)[0]


def test_edge_cases() -> None:
    one = Ring([0])
    assert {one.owner(b"k%d" % i) for i in range(100)} == {0}
    assert one.owners(b"x", 5) == [0]
    assert one.owners(b"x", 0) == []
    p1 = Placement(1, replicas=3)
    assert p1.replicas == 1
    assert p1.locate_data(42) == [0] and p1.locate_metadata(b"") == 0
    assert p1.blobs_for_rank(0, 5) == [0, 1, 2, 3, 4]
    p3 = Placement(3, replicas=5)
    assert p3.replicas == 3
    for b in range(50):
        assert sorted(p3.locate_data(b)) == [0, 1, 2]
    assert Ring(range(3)).owners(b"x", 10) == Ring(range(3)).owners(b"x", 3)
    assert sorted(Ring(range(3)).owners(b"x", 3)) == [0, 1, 2]
    assert Ring([7], vnodes=1, probes=1).owner(b"a") == 7
    assert hash_shares(Ring([7], vnodes=1)) == {7: 1.0}
    with pytest.raises(ValueError):
        Ring([])
    with pytest.raises(ValueError):
        Ring([1, 1])
    with pytest.raises(ValueError):
        Ring([-1])
    with pytest.raises(ValueError):
        Placement(0)
    with pytest.raises(ValueError):
        Placement(2, replicas=0)
    assert Placement(4).locate_metadata(b"") in range(4)
    assert not Placement(4).holds(9, 1)


def test_construction_is_quick_for_large_n() -> None:
    import time

    t = time.perf_counter()
    r = Ring(range(1024))
    assert time.perf_counter() - t < 5.0
    assert len(r.points()[0]) == 1024 * _ring.DEFAULT_VNODES


def test_vectorized_data_placement_matches_the_ring():
    """`_ring_np` (numpy xxh3 of 10-byte data keys, nearest successor, replica walk) gives the
    same blobs per rank as the scalar Placement, and the same hashes as the xxhash library."""
    import numpy as np
    import xxhash

    from fanstore_fuse._ring import RING_SEED
    from fanstore_fuse._ring_np import blobs_for_rank, xxh3_data_keys

    rng = np.random.default_rng(3)
    ids = np.concatenate([np.arange(300, dtype=np.uint64),
                          rng.integers(0, 2**63, 300, dtype=np.uint64) * np.uint64(2)])
    for seed in (RING_SEED, RING_SEED + 7, 0):
        got = xxh3_data_keys(ids, seed)
        want = [xxhash.xxh3_64_intdigest(b"d:" + int(i).to_bytes(8, "little"), seed=seed)
                for i in ids]
        assert [int(g) for g in got] == want
    bcast = np.zeros(5000, dtype=bool)
    bcast[100:200] = True
    for nranks, replicas in ((2, 1), (3, 1), (3, 2), (5, 3), (4, 4)):
        pl = Placement(nranks, replicas, is_broadcast=lambda b: 100 <= b < 200)
        for r in range(nranks):
            assert blobs_for_rank(pl, r, 5000, bcast).tolist() == pl.blobs_for_rank(r, 5000)
    assert blobs_for_rank(Placement(1), 0, 10).tolist() == list(range(10))


def test_placement_split_between_ranks_gives_each_rank_its_blobs():
    """The daemons' start-up split: each rank hashes one slice of the blob ids
    (`blobs_by_rank(lo, hi)`) and the slices, exchanged, give every rank exactly the blobs the
    scalar Placement says it holds (replicas and broadcast blobs included)."""
    import numpy as np

    from fanstore_fuse._ring_np import blobs_by_rank

    bcast = np.zeros(3001, dtype=bool)
    bcast[50:90] = True
    for nranks, replicas in ((3, 1), (3, 2), (4, 3)):
        pl = Placement(nranks, replicas, is_broadcast=lambda b: 50 <= b < 90)
        cuts = [3001 * k // nranks for k in range(nranks + 1)]
        slices = [blobs_by_rank(pl, cuts[k], cuts[k + 1], bcast) for k in range(nranks)]
        for r in range(nranks):
            got = np.concatenate([s[r] for s in slices]).tolist()
            assert got == pl.blobs_for_rank(r, 3001)
