"""Large READs of raw frames answered from a mapping of the local copy (`_shim_mapread.c`,
`FANSTORE_MAPREAD`): checked where they lie, written to /dev/fuse from there (one copy).

On real mounts of an incompressible file (4 MiB chunks stored as raw 128 KiB frames): buffered
reads (the kernel's 1 MiB read-ahead READs) and O_DIRECT reads of 1 MiB and of odd spans byte
for byte, the buffered ones answered by the mapping (its counter), the O_DIRECT ones never
(pread), nor anything with the switch off; a flipped bit in the local copy gives EIO for the
READs over it (never bytes) while the rest of the file reads right; a local partition cut short
gives EIO, and the daemon (which maps that file) lives on and keeps serving."""

from __future__ import annotations

import errno
import mmap
import os
import random
from pathlib import Path

import pytest
from _harness import mounted, prep_cli
from test_framecache import _shim, _shim_counts

from fanstore_fuse._blobstore import BlobStore
from fanstore_fuse._format import CODEC_FRAMED, MANIFEST_NAME
from fanstore_fuse._manifest import read_manifest
from fanstore_fuse._namespace import Namespace

MiB = 1 << 20
NAME = "big.bin"
pytestmark = [pytest.mark.mount, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    """One incompressible file of 2 chunks and a bit (4 MiB chunks: raw frames)."""
    base = tmp_path_factory.mktemp("mapread")
    src = base / "src"
    src.mkdir()
    data = random.Random(5).randbytes(8 * MiB + 300_000)
    (src / NAME).write_bytes(data)
    dest = prep_cli(src, base / "dest", "-p", "1")
    return dest, data


def _where(dest: Path, k: int) -> tuple[str, int, int, int]:
    """Chunk k's partition name, blob offset, frame size and the offset of its frame 3, checked
    to be framed with raw frames only."""
    m = read_manifest(dest / MANIFEST_NAME)
    ns = Namespace(m)
    blob = ns.blobs(ns.resolve(NAME.encode()))[k]
    assert m.blobs["codec"][blob] == CODEC_FRAMED
    store = BlobStore(m, str(dest))
    try:
        t = store.table(blob)
        assert not any(t.zstd), "the test needs raw frames"
        return m.partitions[m.blobs["part"][blob]].name, m.blobs["offset"][blob], t.frame_size, \
            t.offsets[3]
    finally:
        store.close()


def _direct(path: Path, ranges: list[tuple[int, int]]) -> list[bytes]:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, 2 * MiB)
    try:
        return [bytes(buf[:os.preadv(fd, [memoryview(buf)[:n]], off)]) for off, n in ranges]
    finally:
        os.close(fd)
        buf.close()


def _buffered(path: Path, ranges: list[tuple[int, int]]) -> list[bytes]:
    with open(path, "rb", buffering=0) as f:
        return [os.pread(f.fileno(), n, off) for off, n in ranges]


def _spans(data: bytes) -> list[tuple[int, int]]:
    rng = random.Random(9)
    out = [(k * MiB, MiB) for k in range(len(data) // MiB + 1)]
    out += [(rng.randrange(len(data) // 4096) * 4096, rng.choice([256 << 10, 768 << 10, MiB]))
            for _ in range(24)]
    return out


@pytest.mark.parametrize("on", [True, False])
def test_large_raw_reads_byte_for_byte_from_the_mapping_or_not(big, tmp_path: Path,
                                                               state_dir: Path, on: bool):
    _shim()
    dest, data = big
    env = {**os.environ, "FANSTORE_MAPREAD": "1" if on else "0"}
    with mounted(dest, tmp_path / "mnt", state_dir, env=env) as mt:
        path = mt.path / NAME
        spans = _spans(data)
        for (off, n), got in zip(spans, _direct(path, spans), strict=True):
            assert got == data[off:off + n], (off, n)
        direct = _shim_counts(mt)
        assert path.read_bytes() == data  # buffered: 1 MiB read-ahead READs
        for (off, n), got in zip(spans, _buffered(path, spans), strict=True):
            assert got == data[off:off + n], (off, n)
        c = _shim_counts(mt)
    assert direct["c_mapread_reads"] == 0, direct  # O_DIRECT: the pread way
    assert c["c_read_fallbacks"] == 0, c
    if on:
        assert c["c_mapread_reads"] >= len(data) // MiB, c
        assert c["c_mapread_bytes"] >= (len(data) // MiB) * (256 << 10), c
    else:
        assert c["c_mapread_reads"] == 0, c


def test_a_flipped_bit_in_the_local_copy_gives_eio_never_bytes(big, tmp_path: Path,
                                                               state_dir: Path):
    dest, data = big
    part, at, frame, rel = _where(dest, 1)
    local = tmp_path / "local"
    with mounted(dest, tmp_path / "mnt", state_dir, local=local) as mt:
        path = mt.path / NAME
        bad = 4 * MiB + 3 * frame + 77  # in frame 3 of chunk 1
        with open(local / part, "r+b") as f:  # the daemon's copy (its page cache too)
            f.seek(at + rel + 77)
            x = f.read(1)
            f.seek(at + rel + 77)
            f.write(bytes([x[0] ^ 0x10]))
        with pytest.raises(OSError) as ei:
            path.read_bytes()
        assert ei.value.errno == errno.EIO
        for off in (4 * MiB, bad // 4096 * 4096 - 512 * 1024):
            for _ in range(2):  # EIO, or the bytes before the bad frame (a short read): never bad bytes
                try:
                    (got,) = _buffered(path, [(off, MiB)])
                except OSError as e:
                    assert e.errno == errno.EIO
                    continue
                assert got == data[off:off + len(got)] and off + len(got) <= bad, (off, len(got))
        good = [(0, MiB), (6 * MiB, MiB), (8 * MiB, MiB)]
        assert _buffered(path, good) == [data[o:o + n] for o, n in good]
        c = _shim_counts(mt)
    assert c["c_read_fallbacks"] >= 4, c  # each refused in C, then EIO from Python
    assert c["c_mapread_reads"] >= len(good), c


def test_a_truncated_local_partition_gives_eio_and_the_daemon_lives_on(big, tmp_path: Path,
                                                                      state_dir: Path):
    dest, data = big
    part, at, _frame, _rel = _where(dest, 1)
    local = tmp_path / "local"
    with mounted(dest, tmp_path / "mnt", state_dir, local=local) as mt:
        path = mt.path / NAME
        assert _buffered(path, [(4 * MiB, MiB)]) == [data[4 * MiB:5 * MiB]]  # mapped once
        os.truncate(local / part, at + 2 * MiB)  # chunk 1's second half is gone
        with pytest.raises(OSError) as ei:
            _buffered(path, [(6 * MiB, MiB)])
        assert ei.value.errno == errno.EIO
        assert _buffered(path, [(MiB, MiB)]) == [data[MiB:2 * MiB]]
        pids = mt.pids()
        assert pids, "no daemon recorded"
        for pid in pids:  # the daemon must not die of a partition cut short (no SIGBUS)
            os.kill(pid, 0)
        assert path.stat().st_size == len(data)


def test_a_whole_raw_blob_read_at_once_from_the_mapping(tmp_path: Path, state_dir: Path):
    """`--frame-kib 0 --codec none`: a 400 KB file is one raw blob; a buffered read of it is one
    READ of all of it, answered from the mapping (its one xxh3 checked in place); an O_DIRECT
    read of part of it goes the pread way."""
    src = tmp_path / "src"
    src.mkdir()
    data = random.Random(3).randbytes(400_000)
    (src / "w.bin").write_bytes(data)
    dest = prep_cli(src, tmp_path / "dest", "-p", "1", "--frame-kib", "0", "--codec", "none")
    with mounted(dest, tmp_path / "mnt", state_dir) as mt:
        path = mt.path / "w.bin"
        assert path.read_bytes() == data
        c = _shim_counts(mt)
        assert (c["c_mapread_reads"], c["c_mapread_bytes"]) == (1, len(data)), c
        assert _direct(path, [(4096, 300 << 10)]) == [data[4096:4096 + (300 << 10)]]
        assert _shim_counts(mt)["c_mapread_reads"] == 1
