"""Framed blobs (codec 3): the frame codec, prep's choices, version-2 DESTs, partial reads in
process and through a real mount, and corruption of one frame (EIO there, good bytes elsewhere)."""

from __future__ import annotations

import errno
import mmap
import os
import random
import struct
from pathlib import Path

import pytest
import trio
import trio.testing
from _harness import mounted, prep_cli, status_totals

from fanstore_fuse import ChecksumError, FormatError, PrepOptions, prep, verify
from fanstore_fuse._blobcodec import (
    RAW_FRAME_SIZE,
    BlobCodec,
    decode_frame,
    encode,
    parse_table,
    table_size,
)
from fanstore_fuse._blobstore import BlobStore
from fanstore_fuse._format import CODEC_FRAMED, CODEC_RAW, CODEC_ZSTD, MANIFEST_NAME, checksum
from fanstore_fuse._manifest import read_manifest, write_manifest
from fanstore_fuse._namespace import Namespace
from fanstore_fuse._node import LocalBlobSource, Node, Stats

MiB = 1 << 20
FRAME = 64 << 10


def _text(n: int, seed: int = 0) -> bytes:
    rng = random.Random(seed)
    words = [b"alpha", b"beta", b"gamma", b"delta", b"epsilon", b"\n"]
    out = bytearray()
    while len(out) < n:
        out += rng.choice(words) + b" "
    return bytes(out[:n])


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    rng = random.Random(3)
    (src / "rand.bin").write_bytes(rng.randbytes(2 * MiB + 3 * FRAME + 77))  # raw sub-blocks
    (src / "text.txt").write_bytes(_text(2 * MiB + 12345))  # zstd frames
    (src / "small.txt").write_bytes(_text(5000, 1))  # one whole zstd blob
    (src / "mid.bin").write_bytes(rng.randbytes(100_000))  # one whole raw blob
    (src / "victim.bin").write_bytes(rng.randbytes(2 * MiB + 5))  # corrupted by a test
    return src


def _zstd(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(level=3, write_content_size=True).compress(data)


# ---------------------------------------------------------------------------- the codec


@pytest.mark.parametrize("size", [1, 4096, FRAME, FRAME + 1, 5 * FRAME - 3])
@pytest.mark.parametrize("packed", [False, True])
def test_framed_round_trip_and_single_frames(size: int, packed: bool):
    raw = _text(size) if packed else random.Random(size).randbytes(size)
    stored, digest = encode(raw, 4096 if size < FRAME else FRAME, _zstd if packed else None)
    assert BlobCodec().decode(stored, CODEC_FRAMED, len(raw), digest, "t") == raw
    t = parse_table(stored, len(stored), len(raw), digest, "t")
    assert t.offsets[0] == table_size(t.count) and t.offsets[-1] == len(stored)
    for k in range(t.count):
        piece = decode_frame(t, k, stored[t.offsets[k] : t.offsets[k + 1]], "t")
        assert piece == raw[k * t.frame_size : (k + 1) * t.frame_size]
    assert any(t.zstd) == (packed and size > 100)  # 1 byte does not shrink


def test_every_corrupt_byte_is_caught():
    raw = _text(3 * FRAME + 5)
    stored, digest = encode(raw, FRAME, _zstd)
    codec = BlobCodec()
    for pos in range(0, len(stored), max(1, len(stored) // 300)):
        bad = bytearray(stored)
        bad[pos] ^= 0x10
        with pytest.raises(ChecksumError):
            codec.decode(bytes(bad), CODEC_FRAMED, len(raw), digest, "t")
    with pytest.raises(ChecksumError, match="table checksum"):
        codec.decode(stored, CODEC_FRAMED, len(raw), digest ^ 1, "t")
    with pytest.raises(ChecksumError):
        codec.decode(stored[:-1], CODEC_FRAMED, len(raw), digest, "t")
    with pytest.raises(ChecksumError, match="frame table"):
        codec.decode(stored[:6], CODEC_FRAMED, len(raw), digest, "t")


def test_a_bad_frame_fails_alone_and_a_bomb_is_refused():
    raw = random.Random(1).randbytes(4 * 4096)
    stored, digest = encode(raw, 4096, None)
    t = parse_table(stored, len(stored), len(raw), digest, "t")
    bad = bytearray(stored)
    bad[t.offsets[2] + 9] ^= 1
    for k in range(4):
        piece = bytes(bad[t.offsets[k] : t.offsets[k + 1]])
        if k == 2:
            with pytest.raises(ChecksumError, match="frame 2 xxh3"):
                decode_frame(t, k, piece, "t")
        else:
            assert decode_frame(t, k, piece, "t") == raw[k * 4096 : (k + 1) * 4096]
    # A zstd frame that claims more than its frame's raw size is refused before decoding, even
    # with a table that matches the manifest (a hostile prep).
    bomb = _zstd(bytes(1 << 20))
    table = struct.pack("<II", 4096, 1) + struct.pack("<IQ", len(bomb) | (1 << 31), 0)
    with pytest.raises(ChecksumError, match="claims 1048576 bytes"):
        BlobCodec().decode(table + bomb, CODEC_FRAMED, 4096, checksum(table), "t")


# ---------------------------------------------------------------------------- prep


def test_prep_frames_large_chunks_only_and_verifies(tree: Path, tmp_path: Path):
    res = prep(tree, tmp_path / "d", PrepOptions(partitions=2, chunk_size=MiB, frame_size=FRAME))
    m, ns = res.manifest, Namespace(res.manifest)
    codecs = {n: {m.blobs["codec"][b] for b in ns.blobs(ns.resolve(n.encode()))}
              for n in ("rand.bin", "text.txt", "small.txt", "mid.bin")}
    assert codecs["small.txt"] == {CODEC_ZSTD} and codecs["mid.bin"] == {CODEC_RAW}
    assert CODEC_FRAMED in codecs["rand.bin"] and CODEC_FRAMED in codecs["text.txt"]
    store = BlobStore(read_manifest(tmp_path / "d" / MANIFEST_NAME), str(tmp_path / "d"))
    try:
        b = ns.blobs(ns.resolve(b"rand.bin"))[0]
        assert store.table(b).frame_size == RAW_FRAME_SIZE and not any(store.table(b).zstd)
        b = ns.blobs(ns.resolve(b"text.txt"))[0]
        assert store.table(b).frame_size == FRAME and all(store.table(b).zstd)
    finally:
        store.close()
    assert verify(str(tmp_path / "d")).ok
    assert res.stored_bytes < res.raw_bytes


def test_prep_with_frames_is_deterministic_across_workers(tree: Path, tmp_path: Path):
    outs = []
    for w in (1, 2, 4):
        d = tmp_path / f"d{w}"
        prep(tree, d, PrepOptions(partitions=3, chunk_size=MiB, frame_size=FRAME, workers=w))
        outs.append({p.name: p.read_bytes() for p in sorted(d.iterdir())})
    assert outs[0] == outs[1] == outs[2]


def _as_version_2(dest: Path) -> None:
    """Rewrite a DEST prepped without frames as an older prep (format version 2) wrote it."""
    m = read_manifest(dest / MANIFEST_NAME)
    assert CODEC_FRAMED not in set(m.blobs["codec"])
    m.version = 2
    write_manifest(dest / MANIFEST_NAME, m)
    for info in m.partitions:
        with open(dest / info.name, "r+b") as f:
            f.seek(8)
            f.write(struct.pack("<H", 2))


def test_version_2_dests_still_read_and_framed_v2_is_refused(tree: Path, tmp_path: Path):
    dest = tmp_path / "v2"
    prep(tree, dest, PrepOptions(partitions=2, chunk_size=MiB, frame_size=0))
    _as_version_2(dest)
    assert read_manifest(dest / MANIFEST_NAME).version == 2
    assert verify(str(dest)).ok
    # Codec 3 in a version-2 manifest is not something version 2 had.
    framed = tmp_path / "v3"
    prep(tree, framed, PrepOptions(partitions=2, chunk_size=MiB, frame_size=FRAME))
    m = read_manifest(framed / MANIFEST_NAME)
    m.version = 2
    write_manifest(framed / MANIFEST_NAME, m)
    with pytest.raises(FormatError, match="unknown codec"):
        read_manifest(framed / MANIFEST_NAME)


# ---------------------------------------------------------------------------- in process


async def test_small_reads_decode_one_frame(tree: Path, tmp_path: Path):
    dest = tmp_path / "d"
    prep(tree, dest, PrepOptions(partitions=1, chunk_size=MiB, frame_size=FRAME))
    m = read_manifest(dest / MANIFEST_NAME)
    store = BlobStore(m, str(dest))
    stats = Stats()
    node = Node(Namespace(m), LocalBlobSource(store, stats, 256 << 10), stats, 64 << 20, 2)
    rng = random.Random(5)
    try:
        async with trio.open_nursery() as n:
            node.attach(n)
            for name in ("rand.bin", "text.txt"):
                want = (tree / name).read_bytes()
                index = node.ns.resolve(name.encode())
                before = stats.local_bytes
                # 4 KiB reads going backwards (not sequential: no read-ahead), inside frames.
                for off in range(len(want) - 5000, FRAME, -300_000)[:20]:
                    off -= rng.randrange(1000)
                    assert await node.read(index, off, 4096) == want[off : off + 4096]
                await trio.testing.wait_all_tasks_blocked()
                frame = RAW_FRAME_SIZE if name == "rand.bin" else FRAME
                assert stats.local_bytes - before <= 7 * 2 * frame  # not whole chunks, nor more
                for off in range(0, len(want), 300_000):  # sequential: whole blobs
                    assert await node.read(index, off, 300_000) == want[off : off + 300_000]
                    await trio.testing.wait_all_tasks_blocked()
            assert stats.cache_hits > 0
    finally:
        store.close()


# ---------------------------------------------------------------------------- mounted


@pytest.mark.mount
@pytest.mark.timeout(120)
def test_mounted_random_ranges_and_one_corrupt_frame(tree: Path, tmp_path: Path, state_dir: Path):
    dest = prep_cli(tree, tmp_path / "dest", "-p", "2", "--chunk-mib", "1", "--frame-kib", "64")
    m = read_manifest(dest / MANIFEST_NAME)
    ns = Namespace(m)
    rng = random.Random(11)
    local = tmp_path / "local"
    with mounted(dest, tmp_path / "mp", state_dir, local=local) as mt:
        # Corrupt one raw sub-block in the middle of victim.bin's second chunk, in the local
        # copy, before anything read it (the page cache would keep good bytes).
        blob = ns.blobs(ns.resolve(b"victim.bin"))[1]
        store = BlobStore(m, str(dest))
        t = store.table(blob)
        store.close()
        k = 40  # 640 KiB into the chunk
        part = local / m.partitions[m.blobs["part"][blob]].name
        with open(part, "r+b") as f:  # same inode: the daemon's open fd sees it
            pos = m.blobs["offset"][blob] + t.offsets[k] + 123
            f.seek(pos)
            byte = f.read(1)
            f.seek(pos)
            f.write(bytes([byte[0] ^ 0x20]))
        want = (tree / "victim.bin").read_bytes()
        bad = MiB + k * RAW_FRAME_SIZE
        # O_DIRECT: the kernel asks for exactly these ranges (buffered reads come in large
        # folios and read-ahead windows that may cover the bad frame).
        fd = os.open(mt.path / "victim.bin", os.O_RDONLY | os.O_DIRECT)
        buf = mmap.mmap(-1, 4096)
        try:
            for off in (bad, bad + 4096, bad + RAW_FRAME_SIZE - 4096):
                with pytest.raises(OSError) as ei:
                    os.preadv(fd, [buf], off)
                assert ei.value.errno == errno.EIO
            # The rest of the same chunk, the sub-blocks around it, and the file read correctly.
            for off in (MiB, MiB + 4096, bad - 4096, bad + RAW_FRAME_SIZE, 0, len(want) - 5):
                try:
                    n = os.preadv(fd, [buf], off)
                except OSError as e:
                    raise AssertionError(f"offset {off}, bad frame at {bad}: {e}") from None
                assert buf[:n] == want[off : off + 4096], off
        finally:
            os.close(fd)
        with pytest.raises(OSError) as ei:
            (mt.path / "victim.bin").read_bytes()
        assert ei.value.errno == errno.EIO
        for name in ("rand.bin", "text.txt", "small.txt", "mid.bin"):
            want = (tree / name).read_bytes()
            fd = os.open(mt.path / name, os.O_RDONLY)
            try:
                for _ in range(150):
                    off = rng.randint(0, len(want) + 10)
                    n = rng.choice([1, 100, 4096, 5000, FRAME, 131072, MiB + 7])
                    assert os.pread(fd, n, off) == want[off : off + n], (name, off, n)
            finally:
                os.close(fd)
            assert (mt.path / name).read_bytes() == want
        assert status_totals(mt.status())["errors"] >= 1
        mt.umount()
        assert "frame 40 xxh3 checksum mismatch" in mt.log_text()
