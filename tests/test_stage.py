"""Stage-in of a rank's share without FUSE: dense local copies (blobs back to back, an offset
table in memory) take disk in proportion to the share, even for blobs far under 4 KiB."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fanstore_fuse import ChecksumError, PrepOptions, prep, read_manifest
from fanstore_fuse._blobstore import BlobStore
from fanstore_fuse._format import MANIFEST_NAME, PARTITION_DATA_START
from fanstore_fuse._ring import Placement
from fanstore_fuse._stage import plan_dense, stage_in


def _disk(path: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in path.glob("*.fsp"))


@pytest.mark.parametrize("replicas", [1, 2])
def test_dense_share_of_tiny_files(tmp_path: Path, replicas: int):
    src = tmp_path / "src"
    src.mkdir()
    data = {f"f{i:05d}": os.urandom(64 + i % 449) for i in range(3000)}
    for name, b in data.items():
        (src / name).write_bytes(b)
    dest = tmp_path / "dest"
    # One partition: thousands of a rank's blobs lie close together (more than IOV_MAX pieces).
    prep(src, dest, PrepOptions(partitions=1, codec="none", workers=1))
    m = read_manifest(dest / MANIFEST_NAME)
    pl = Placement(3, replicas)
    total = sum(p.size - PARTITION_DATA_START for p in m.partitions)
    held_by = {}
    for rank in range(3):
        held = pl.blobs_for_rank(rank, m.n_blobs)
        held_by[rank] = set(held)
        shares, dense = plan_dense(m, held)
        local = tmp_path / f"local{rank}"
        res = stage_in(str(dest), str(local), m, shares)
        share = sum(m.blobs["stored"][b] for b in held)
        assert res.bytes == share + PARTITION_DATA_START * len(shares)
        # Disk in proportion to the share: at most 1.1x plus one block per file for the tail.
        assert _disk(local) <= 1.1 * share + 4096 * len(shares), (_disk(local), share, total)
        store = BlobStore(m, str(local), dense)
        try:
            for b in held:
                assert store.raw(b) is not None  # decoded and xxh3-verified
            other = next(b for b in range(m.n_blobs) if b not in held_by[rank])
            with pytest.raises(ChecksumError, match="not held"):
                store.raw(other)
        finally:
            store.close()
    assert set().union(*held_by.values()) == set(range(m.n_blobs))
    print(f"replicas {replicas}: share/rank ~ {replicas / 3:.2f} of {total} bytes")
