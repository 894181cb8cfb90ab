"""The disk cache of remote blobs on a real 2-rank mount: every file read three times and compared
with the source (the second pass from the cache, the third after damaging its segment files)."""

from __future__ import annotations

import os
import time

import pytest
from _diskcache_helpers import damage
from _harness import build_tree, prep_cli, snapshot, status_ranks
from _pagecache import drop_page_cache

from fanstore_fuse._diskcache import DATA_START
from fanstore_fuse._format import MANIFEST_NAME
from fanstore_fuse._manifest import read_manifest
from fanstore_fuse._node import BlobCache
from fanstore_fuse._ring import Placement


def _read_all(mp: str, rels: list[bytes]) -> dict[bytes, bytes]:
    out = {}
    for r in rels:
        with open(os.path.join(os.fsencode(mp), r), "rb") as f:
            out[r] = f.read()
    return out


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
    """Rank 0's status once its disk cache holds `n` entries (written behind the reads, by the
    cache's writer thread)."""
    deadline = time.monotonic() + 30
    while (st := status_ranks(m.status())[0])["disk_cache"]["entries"] < n:
        assert time.monotonic() < deadline and not st["disk_cache"]["skipped"], st["disk_cache"]
        time.sleep(0.02)
    return st


@pytest.mark.mount
@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_two_ranks_second_pass_from_the_disk_cache(tmp_path, mount_factory):
    """Every file read three times through rank 0 and compared with the source: the second pass
    from the disk cache (its hits counted as local reads), the third after damaging the cache's
    segment files (a bad entry is dropped and the blob fetched again)."""
    src = build_tree(tmp_path / "src")
    dest = prep_cli(src, tmp_path / "dest", "--chunk-mib", "1", "-p", "3")
    rels = sorted(p for p, meta in snapshot(src, contents=False)[0].items() if meta.kind == "-")
    want = _read_all(str(src), rels)
    m, mp, man, remote = _mount_two(tmp_path, mount_factory, dest, {})

    def rank0() -> dict:
        return status_ranks(m.status())[0]

    assert _read_all(mp, rels) == want
    first = rank0()
    assert first["stats"]["remote_reads"] >= len(remote)
    assert first["disk_cache"]["misses"] >= len(remote)
    first = _wait_cached(m, len(remote))
    paths = [os.path.join(os.fsencode(mp), r) for r in rels]
    drop_page_cache(paths)
    assert _read_all(mp, rels) == want
    second = rank0()
    assert second["stats"]["remote_reads"] == first["stats"]["remote_reads"]  # nothing fetched
    assert second["disk_cache"]["entries"] == len(remote)
    hits = second["disk_cache"]["hits"] - first["disk_cache"]["hits"]
    # every remote blob from the disk cache, but for the last few blobs of files read in several
    # READs, still in the memory cache's slots for blobs over its limit (a READ of a whole
    # one-blob file keeps nothing there)
    memory = second["stats"]["cache_hits"] - first["stats"]["cache_hits"]
    assert hits >= len(remote) - BlobCache.BIG_SLOTS and hits + memory >= len(remote)
    local = second["stats"]["local_reads"] - first["stats"]["local_reads"]
    assert local >= hits  # a disk cache hit is a local read
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
    assert "disk cache: blob" in m.log_text()
    m.umount()
    assert not (tmp_path / "local" / "0" / "cache").exists()
