"""The disk cache of remote blobs on a real 2-rank mount: every file read three times and compared
with the source (the second pass from the cache, the third after damaging its segment files)."""

from __future__ import annotations

import os
import time

import pytest
from _diskcache_helpers import damage
from _harness import build_tree, c_remote, prep_cli, snapshot, status_ranks
from _pagecache import drop_page_cache

from fanstore_fuse._diskcache import DATA_START
from fanstore_fuse._format import MANIFEST_NAME
from fanstore_fuse._manifest import read_manifest
from fanstore_fuse._ring import Placement


def _read_all(mp: str, rels: list[bytes]) -> dict[bytes, bytes]:
    out = {}
    for r in rels:
        with open(os.path.join(os.fsencode(mp), r), "rb") as f:
            out[r] = f.read()
    return out


WHOLE_MAX = 512 << 10  # _shim_read.c: blobs the shim reads whole for a READ


def _mount_two(tmp_path, mount_factory, dest, env: dict[str, str]):
    """Two ranks with a 64 MiB disk cache and a 1-byte blob cache in memory (every read reaches
    the blob source): the mount, rank 0's mountpoint, the manifest, the blobs rank 0 lacks."""
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=2,
                      local=str(tmp_path / "local" / "{rank}"), extra_args=["--cache-size", "64M"],
                      env={"FANSTORE_CACHE_BYTES": "1", **env})
    man = read_manifest(dest / MANIFEST_NAME)
    remote = [b for b in range(man.n_blobs) if not Placement(2, 1).holds(0, b)]
    assert remote
    return m, m.mountpoints[0], man, remote


def _wait_cached(m, n: int) -> dict:
    """Rank 0's status once its disk cache holds `n` entries. They are written behind the
    reads: offers from C reach Python in batches (16 blobs, 8 MiB or 20 ms), then the writer
    thread appends them."""
    deadline = time.monotonic() + 30
    while (st := status_ranks(m.status())[0])["disk_cache"]["entries"] < n:
        assert time.monotonic() < deadline and not st["disk_cache"]["skipped"], st["disk_cache"]
        time.sleep(0.02)
    return st


@pytest.mark.mount
@pytest.mark.mpi
@pytest.mark.timeout(240)
@pytest.mark.parametrize("cache_c", ["1", "0"])
def test_two_ranks_second_pass_from_the_disk_cache(tmp_path, mount_factory, cache_c):
    """Every file read three times through rank 0 and compared with the source: the second pass
    from the disk cache (in C unless FANSTORE_CACHE_C=0), the third after damaging the cache's
    segment files (the shim hands what fails its check to Python, which refetches)."""
    src = build_tree(tmp_path / "src")
    dest = prep_cli(src, tmp_path / "dest", "--chunk-mib", "1", "-p", "3")
    rels = sorted(p for p, meta in snapshot(src, contents=False)[0].items() if meta.kind == "-")
    want = _read_all(str(src), rels)
    m, mp, man, remote = _mount_two(tmp_path, mount_factory, dest, {"FANSTORE_CACHE_C": cache_c})
    small = [b for b in remote if man.blobs["raw"][b] <= WHOLE_MAX]  # read whole in C
    assert small

    def rank0() -> dict:
        return status_ranks(m.status())[0]

    def hits(st: dict) -> tuple[int, int]:  # (Python's, C's)
        c = st["disk_cache"]["c_hits"]
        assert c == st["fuse_shim"].get("c_cache_hits", 0)  # one cache in the daemon
        return st["disk_cache"]["hits"] - c, c

    assert _read_all(mp, rels) == want
    first = rank0()
    assert first["stats"]["remote_reads"] >= len(remote)
    assert first["disk_cache"]["misses"] >= len(remote)  # C remote READs count them too
    first = _wait_cached(m, len(remote))
    paths = [os.path.join(os.fsencode(mp), r) for r in rels]
    drop_page_cache(paths)
    assert _read_all(mp, rels) == want
    second = rank0()
    assert second["stats"]["remote_reads"] == first["stats"]["remote_reads"]  # nothing fetched
    assert second["disk_cache"]["entries"] == len(remote)
    py_hits, c_hits = (b - a for a, b in zip(hits(first), hits(second)))
    assert py_hits + c_hits >= len(remote)
    if cache_c == "1":  # the shim read every small cached blob itself
        assert c_hits >= len(small)
        assert py_hits <= (len(remote) - len(small)) * 8  # big ones: Python, per 128 KiB READ
    else:
        assert c_hits == 0 and py_hits >= len(remote)
    # Damage rank 0's cache files: the next pass still reads exact bytes, fetching again.
    segs = sorted((tmp_path / "local" / "0" / "cache").glob("seg-*.fsc"))
    assert segs
    for seg in segs:
        damage(seg, range(DATA_START + 11, seg.stat().st_size, 4099))
    drop_page_cache(paths)
    assert _read_all(mp, rels) == want
    third = rank0()
    assert third["disk_cache"]["corrupt"] > 0
    assert third["stats"]["remote_reads"] > second["stats"]["remote_reads"]
    if cache_c == "1":
        assert third["fuse_shim"]["c_cache_fallbacks"] > second["fuse_shim"]["c_cache_fallbacks"]
    assert "disk cache: blob" in m.log_text()
    m.umount()
    assert not (tmp_path / "local" / "0" / "cache").exists()


def _small_tree(root, n: int = 160) -> list[bytes]:
    import random

    rng = random.Random(12)
    rels = []
    for i in range(n):
        rel = f"d{i % 4}/f{i:03d}.bin"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(rng.randbytes(rng.randint(8_000, 40_000)))
        rels.append(os.fsencode(rel))
    return rels


@pytest.mark.timeout(240)
@pytest.mark.parametrize("batch", ["16", "1"])
@c_remote
def test_blobs_offered_to_the_disk_cache_are_announced_in_batches(tmp_path, mount_factory, batch):
    """Blobs that READs in C fetched reach Python's disk cache in batches (FANSTORE_OFFER_BATCH,
    default 16; 1: one wake-up of Python per blob, as before): every remote blob is still cached,
    within the time bound (20 ms after the oldest offer), and every file reads back byte for
    byte, the second pass from the cache without fetching."""
    src = tmp_path / "src"
    rels = _small_tree(src)
    dest = prep_cli(src, tmp_path / "dest", "-p", "4")
    want = _read_all(str(src), rels)
    m, mp, _, remote = _mount_two(tmp_path, mount_factory, dest, {"FANSTORE_OFFER_BATCH": batch})
    assert len(remote) > 32
    assert _read_all(mp, rels) == want
    st = _wait_cached(m, len(remote))
    offers, pokes = st["c_remote"]["cache_offers"], st["c_remote"]["offer_pokes"]
    assert offers >= len(remote), st["c_remote"]
    if batch == "16":
        assert 0 < pokes * 4 <= offers, (pokes, offers)
    else:
        assert pokes * 2 >= offers, (pokes, offers)
    fetched = st["c_remote"]["fetched"]
    drop_page_cache([os.path.join(os.fsencode(mp), r) for r in rels])
    assert _read_all(mp, rels) == want
    assert status_ranks(m.status())[0]["c_remote"]["fetched"] == fetched  # all from the cache
