"""Raw sub-blocks: an incompressible file is stored as raw 16 KiB sub-blocks, each with its own
xxh3; an O_DIRECT 4 KiB READ reads and checks only the sub-block it covers. On a real mount:
O_DIRECT random 4 KiB reads byte for byte, and EIO (never bytes) for a corrupt sub-block, read
again and again, while its neighbour of the same blob reads right before and after."""

from __future__ import annotations

import errno
import json
import os
import random
from pathlib import Path

import pytest
from _harness import mounted, prep_cli, status_ranks
from test_framereads import _odirect

from fanstore_fuse._blobcodec import RAW_FRAME_SIZE as SUB
from fanstore_fuse._blobstore import BlobStore
from fanstore_fuse._format import CODEC_FRAMED, MANIFEST_NAME
from fanstore_fuse._manifest import read_manifest
from fanstore_fuse._namespace import Namespace

KiB, MiB = 1 << 10, 1 << 20
NAME = "r.bin"


@pytest.fixture
def raw_dataset(tmp_path: Path) -> tuple[Path, bytes]:
    """One incompressible file of 3 chunks and a bit (1 MiB chunks: raw 16 KiB sub-blocks)."""
    src = tmp_path / "src"
    src.mkdir()
    data = random.Random(21).randbytes(3 * MiB + 5_000)
    (src / NAME).write_bytes(data)
    dest = prep_cli(src, tmp_path / "dest", "-p", "1", "--chunk-mib", "1", "--codec", "none")
    return dest, data


def _blob(dest: Path, k: int = 1) -> tuple[BlobStore, int]:
    """The file's blob k (its MiB k), checked to be framed with raw sub-blocks only."""
    m = read_manifest(dest / MANIFEST_NAME)
    ns = Namespace(m)
    blob = ns.blobs(ns.resolve(NAME.encode()))[k]
    assert m.blobs["codec"][blob] == CODEC_FRAMED
    store = BlobStore(m, str(dest))
    t = store.table(blob)
    assert t.frame_size == SUB and not any(t.zstd), "the test needs raw sub-blocks"
    return store, blob


def _flip(dest: Path, blob: int, sub: int, at: int = 100, where: Path | None = None) -> None:
    """Flip one bit of raw sub-block `sub` of `blob` in its partition file (in `where`: a
    mount's local copy; default: DEST's own)."""
    store = BlobStore(read_manifest(dest / MANIFEST_NAME), str(dest))
    try:
        m, t = store.m, store.table(blob)
        part = (where or dest) / m.partitions[m.blobs["part"][blob]].name
        pos = m.blobs["offset"][blob] + t.offsets[sub] + at
    finally:
        store.close()
    with open(part, "r+b") as f:
        f.seek(pos)
        x = f.read(1)
        f.seek(pos)
        f.write(bytes([x[0] ^ 0x04]))


# ---------------------------------------------------------------------------- real mounts


@pytest.mark.mount
@pytest.mark.timeout(180)
def test_mounted_odirect_random_4k_reads_of_sub_blocks(raw_dataset, tmp_path: Path,
                                                              state_dir: Path):
    dest, data = raw_dataset
    rng = random.Random(8)
    pages = [rng.randrange(len(data) // 4096) * 4096 for _ in range(400)]
    ranges = [(p, 4096) for p in pages]
    with mounted(dest, tmp_path / "mnt", state_dir) as mt:
        for (off, n), got in zip(ranges, _odirect(mt.path / NAME, ranges)):
            assert got == data[off:off + n], off
        assert (mt.path / NAME).read_bytes() == data
        s = _stats(mt)
    assert s["reads"] >= len(pages) and s["errors"] == 0, s


@pytest.mark.mount
@pytest.mark.timeout(180)
def test_mounted_corrupt_sub_block_gives_eio_beside_a_good_neighbour(raw_dataset, tmp_path: Path,
                                                                    state_dir: Path):
    dest, data = raw_dataset
    store, blob = _blob(dest)
    store.close()
    good, bad = 10, 11
    local = tmp_path / "local"
    with mounted(dest, tmp_path / "mnt", state_dir, local=local) as mt:
        path = mt.path / NAME
        base = MiB  # blob 1 is the file's second MiB
        g = base + good * SUB
        assert _odirect(path, [(g, 4096)]) == [data[g:g + 4096]]
        _flip(dest, blob, bad, where=local)  # the copy the daemon reads (page cache too)
        for _ in range(2):
            for off in (0, 4096, SUB - 4096):
                with pytest.raises(OSError) as ei:
                    _odirect(path, [(base + bad * SUB + off, 4096)])
                assert ei.value.errno == errno.EIO
        ranges = [(g + off, 4096) for off in (4096, 8192, SUB - 4096)]
        assert _odirect(path, ranges) == [data[o:o + n] for o, n in ranges]
        s = _stats(mt)
    assert s["errors"] >= 6, s  # each corrupt READ counted (and logged): EIO


def _stats(mt) -> dict[str, int]:
    return status_ranks(json.loads(os.getxattr(mt.path, "user.fanstore.status")))[0]["stats"]
