"""Cold reads: real mounts whose staged copies (and disk cache segments) were evicted for sure
(`drop_page_cache`, checked with `mincore`), every file compared byte for byte: one rank, a
serving rank whose copy is cold when its peer reads, and epoch 2 of a 2-rank mount from a cold
disk cache of remote blobs."""

from __future__ import annotations

import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from _harness import mounted, mpi_mount, prep_cli, status_ranks
from _pagecache import drop_page_cache, files_pages, staged_copies

pytestmark = [pytest.mark.mount]


def _tree(src: Path, n: int = 300, seed: int = 3) -> dict[str, bytes]:
    rng = random.Random(seed)
    files = {f"d{i % 6}/f{i:03d}.bin": rng.randbytes(rng.randint(20_000, 60_000)) for i in range(n)}
    for rel, body in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(body)
    return files


def _read_all(root: Path, files: dict[str, bytes], seed: int) -> None:
    names = sorted(files)
    random.Random(seed).shuffle(names)
    for rel in names:
        with open(root / rel, "rb") as f:
            assert f.read() == files[rel], rel


def _evict(parts: list[Path]) -> None:
    """The copies out of the page cache, and the mount's own cached pages (root only)."""
    drop_page_cache(parts)
    assert files_pages(parts)[0] == 0
    os.system("echo 1 > /proc/sys/vm/drop_caches")


@pytest.mark.timeout(180)
def test_cold_reads_of_the_local_copy(tmp_path, state_dir):
    files = _tree(tmp_path / "src")
    dest = prep_cli(tmp_path / "src", tmp_path / "dest")
    local = tmp_path / "local"
    with mounted(dest, tmp_path / "mnt", state_dir, local=local) as m:
        parts = staged_copies(local)
        for k in (1, 2):
            _evict(parts)
            _read_all(m.path, files, seed=k)
        s = status_ranks(m.status())[0]["stats"]
        assert s["errors"] == 0 and s["local_reads"] >= len(files), s


@pytest.mark.timeout(240)
@mpi_mount
def test_a_serving_rank_with_a_cold_copy(tmp_path, state_dir):
    """Rank 0 reads the blobs only rank 1 holds while rank 1's copy is cold: with one reader
    rank 1's MPI thread reads each small blob itself (no disk thread is busy), with four at
    once its disk threads read them too; every file reads back byte for byte."""
    files = _tree(tmp_path / "src", n=300, seed=7)
    dest = prep_cli(tmp_path / "src", tmp_path / "dest", "-p", "4")
    local = tmp_path / "local"
    with mounted(dest, str(tmp_path / "mnt" / "{rank}"), state_dir, ranks=2,
                 local=str(local / "{rank}"), env={"FANSTORE_CACHE_SIZE": "0",
                                                  "FANSTORE_CACHE_BYTES": str(1 << 20)}) as m:
        root = Path(m.mountpoints[0])
        _evict(staged_copies(local / "1"))
        _read_all(root, files, seed=2)
        r0, r1 = status_ranks(m.status())
        assert r0["stats"]["remote_reads"] > 0 and r0["stats"]["errors"] == 0, r0
        assert r1["mpi_served_inline"] > 0 and r1["mpi_served_by_io"] == 0, r1
        _evict(staged_copies(local / "1"))
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda k: _read_all(root, files, seed=10 + k), range(4)))
        r0, r1 = status_ranks(m.status())
        assert r0["stats"]["errors"] == 0, r0
        assert r1["mpi_served_by_io"] > 0, r1  # several cold requests at once: disk threads


@pytest.mark.timeout(240)
@mpi_mount
def test_cold_reads_of_the_disk_cache(tmp_path, state_dir):
    """Epoch 2 of a 2-rank mount: rank 0 reads the blobs rank 1 holds from its disk cache of
    remote blobs, with the cache's segments (and rank 0's copy) evicted: every file reads back
    byte for byte, from the cache (no new fetch)."""
    files = _tree(tmp_path / "src", n=300, seed=9)
    dest = prep_cli(tmp_path / "src", tmp_path / "dest", "-p", "4")
    local = tmp_path / "local"
    with mounted(dest, str(tmp_path / "mnt" / "{rank}"), state_dir, ranks=2,
                 local=str(local / "{rank}"), env={"FANSTORE_CACHE_BYTES": str(1 << 20)}) as m:
        root = Path(m.mountpoints[0])
        _read_all(root, files, seed=1)  # epoch 1: rank 1's blobs fetched and cached on rank 0
        first = status_ranks(m.status())[0]
        deadline = time.monotonic() + 30
        while (st := status_ranks(m.status())[0])["disk_cache"]["entries"] < first["stats"]["remote_reads"]:
            assert time.monotonic() < deadline, st["disk_cache"]
            time.sleep(0.05)
        segments = sorted((local / "0" / "cache").glob("seg-*.fsc"))
        assert segments, list((local / "0").rglob("*"))
        _evict(staged_copies(local / "0") + segments)
        _read_all(root, files, seed=2)
        second = status_ranks(m.status())[0]
        assert second["stats"]["remote_reads"] == first["stats"]["remote_reads"], second["stats"]
        cache = second["disk_cache"]
        assert cache["hits"] > 0 and cache["corrupt"] == 0, cache
