"""Raw sub-blocks kept in C (`_shim_fcache.c`, `FANSTORE_SUBBLOCK_CACHE`): an incompressible
file is stored as raw 16 KiB sub-blocks, each with its own xxh3; an O_DIRECT 4 KiB READ reads
and checks a whole sub-block, which the frame cache then keeps so that its other pages skip
the pread and the xxh3. In process: random ranges against the source with the hit counter,
the switch off, a corrupt sub-block refused every time while its good neighbour stays kept,
and a kept copy that never hides a corrupt sub-block read afresh. On a real mount: O_DIRECT
random 4 KiB reads byte for byte, and EIO (never bytes) for a corrupt sub-block right after a
good neighbour of the same blob was kept."""

from __future__ import annotations

import contextlib
import errno
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from _harness import mounted, prep_cli
from test_framecache import _counts, _odirect, _shim, _shim_counts

from fanstore_fuse import _fastread
from fanstore_fuse._blobcodec import RAW_FRAME_SIZE as SUB
from fanstore_fuse._blobstore import BlobStore
from fanstore_fuse._format import CODEC_FRAMED, MANIFEST_NAME
from fanstore_fuse._manifest import read_manifest
from fanstore_fuse._namespace import Namespace

KiB, MiB = 1 << 10, 1 << 20
CORRUPT = -4  # FANSTORE_BLOB_CORRUPT
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


@contextlib.contextmanager
def _held(dest: Path, budget: int, subblocks: bool = True) -> Iterator[tuple[object, int]]:
    shim = _shim()
    store, blob = _blob(dest)
    try:
        _fastread.hold_blobs(store)
        shim.frame_cache(budget, False, subblocks)
        yield shim, blob
    finally:
        shim.frame_cache(0, False)
        shim.drop_blobs()
        store.close()


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


# ---------------------------------------------------------------------------- in process


def test_random_4k_ranges_keep_each_sub_block_once(raw_dataset):
    dest, data = raw_dataset
    raw = data[MiB:2 * MiB]
    rng = random.Random(5)
    with _held(dest, 64 * MiB) as (shim, blob):
        subs = set()
        for _ in range(400):
            lo = rng.randrange(MiB // 4096) * 4096
            subs.add(lo // SUB)
            assert shim.blob_read(blob, lo, lo + 4096) == raw[lo:lo + 4096], lo
        c = _counts(shim)
        assert c["c_frame_misses"] == len(subs), c  # each sub-block read and checked once
        assert c["c_frame_hits"] == 400 - len(subs), c
        assert c["c_frame_entries"] == len(subs) and c["c_frame_bytes"] == len(subs) * SUB, c
        # Whole sub-blocks and ranges across two are read and checked in place, not kept.
        assert shim.blob_read(blob, SUB, 2 * SUB) == raw[SUB:2 * SUB]
        assert shim.blob_read(blob, SUB - 10, SUB + 10) == raw[SUB - 10:SUB + 10]
        assert _counts(shim)["c_frame_misses"] == len(subs)


def test_sub_blocks_off_keeps_nothing(raw_dataset):
    dest, data = raw_dataset
    with _held(dest, 64 * MiB, subblocks=False) as (shim, blob):
        for _ in range(3):
            assert shim.blob_read(blob, 4096, 8192) == data[MiB + 4096:MiB + 8192]
        c = _counts(shim)
    assert c["c_frame_entries"] == 0 and c["c_frame_hits"] == c["c_frame_misses"] == 0, c


def test_a_corrupt_sub_block_is_refused_beside_a_kept_neighbour(raw_dataset):
    dest, data = raw_dataset
    raw = data[MiB:2 * MiB]
    good, bad = 6, 7
    _, blob = _blob(dest)
    _flip(dest, blob, bad)
    with _held(dest, 64 * MiB) as (shim, blob):
        lo = good * SUB + 4096
        assert shim.blob_read(blob, lo, lo + 4096) == raw[lo:lo + 4096]  # kept
        for off in (0, 4096, SUB - 4096, 0):  # every page of the corrupt one, every time
            with pytest.raises(OSError) as ei:
                shim.blob_read(blob, bad * SUB + off, bad * SUB + off + 4096)
            assert ei.value.args[0] == CORRUPT
        c = _counts(shim)
        assert c["c_frame_entries"] == 1 and c["c_frame_hits"] == 0, c
        for off in (0, 8192, SUB - 4096):  # the good neighbour's other pages: from the cache
            lo = good * SUB + off
            assert shim.blob_read(blob, lo, lo + 4096) == raw[lo:lo + 4096]
        assert _counts(shim)["c_frame_hits"] == 3


def test_a_kept_copy_never_hides_a_corrupt_read(raw_dataset):
    """The cache keeps the bytes it checked, not a "checked" mark: once the copy is gone, the
    sub-block is read and checked again, and a byte changed on disk meanwhile is refused."""
    dest, data = raw_dataset
    raw = data[MiB:2 * MiB]
    sub = 3
    lo = sub * SUB + 8192
    with _held(dest, 64 * MiB) as (shim, blob):
        assert shim.blob_read(blob, lo, lo + 4096) == raw[lo:lo + 4096]
        _flip(dest, blob, sub, at=50)
        assert shim.blob_read(blob, lo, lo + 4096) == raw[lo:lo + 4096]  # the checked copy
        shim.frame_cache(64 * MiB, False)  # the copy dropped
        with pytest.raises(OSError) as ei:
            shim.blob_read(blob, lo, lo + 4096)
        assert ei.value.args[0] == CORRUPT


# ---------------------------------------------------------------------------- real mounts


@pytest.mark.mount
@pytest.mark.timeout(180)
def test_mounted_odirect_random_4k_reads_from_kept_sub_blocks(raw_dataset, tmp_path: Path,
                                                              state_dir: Path):
    _shim()
    dest, data = raw_dataset
    rng = random.Random(8)
    pages = [rng.randrange(len(data) // 4096) * 4096 for _ in range(400)]
    ranges = [(p, 4096) for p in pages]
    with mounted(dest, tmp_path / "mnt", state_dir) as mt:
        for (off, n), got in zip(ranges, _odirect(mt.path / NAME, ranges)):
            assert got == data[off:off + n], off
        c = _shim_counts(mt)
        assert (mt.path / NAME).read_bytes() == data
    subs = {p // SUB for p in pages if p + 4096 <= 3 * MiB}  # the tail blob is not framed
    assert c["c_frame_misses"] == len(subs), c
    assert c["c_frame_hits"] >= len([p for p in pages if p + 4096 <= 3 * MiB]) - len(subs), c
    assert c["c_frame_pushes"] == 0 and c["c_read_fallbacks"] == 0, c


@pytest.mark.mount
@pytest.mark.timeout(180)
def test_mounted_corrupt_sub_block_gives_eio_after_a_kept_neighbour(raw_dataset, tmp_path: Path,
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
        assert _odirect(path, [(g, 4096)]) == [data[g:g + 4096]]  # kept
        _flip(dest, blob, bad, where=local)  # the copy the daemon reads (page cache too)
        for _ in range(2):
            for off in (0, 4096, SUB - 4096):
                with pytest.raises(OSError) as ei:
                    _odirect(path, [(base + bad * SUB + off, 4096)])
                assert ei.value.errno == errno.EIO
        ranges = [(g + off, 4096) for off in (4096, 8192, SUB - 4096)]
        assert _odirect(path, ranges) == [data[o:o + n] for o, n in ranges]
        c = _shim_counts(mt)
    assert c["c_read_fallbacks"] >= 6, c  # each corrupt READ handed to Python: EIO
    assert c["c_frame_hits"] >= 3, c
