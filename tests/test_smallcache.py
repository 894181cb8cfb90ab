"""A blob cache smaller than one chunk (`FANSTORE_CACHE_BYTES` below the chunk size): every
chunk of a file read sequentially is fetched once, not once per FUSE read of it."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import trio
from _harness import prep_cli, status_ranks

from fanstore_fuse._node import BlobCache, Stats

MiB = 1 << 20
CHUNK_MIB = 2
STEP = 128 << 10  # the read size of a buffered reader's requests at the default read-ahead


def _write(src: Path) -> dict[str, bytes]:
    rng = random.Random(3)
    files = {
        "rand.bin": rng.randbytes(3 * CHUNK_MIB * MiB + 12345),  # raw sub-blocks
        "text.txt": b"".join(b"line %d of a compressible file\n" % i for i in range(230_000)),
    }
    src.mkdir()
    for name, data in files.items():
        (src / name).write_bytes(data)
    return files


def _read(path: str, size: int) -> bytes:
    """Read a whole file in STEP preads after dropping its pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return b"".join(os.pread(fd, STEP, off) for off in range(0, size, STEP))
    finally:
        os.close(fd)


def _chunks(size: int) -> int:
    return -(-size // (CHUNK_MIB * MiB))


@pytest.mark.mount
@pytest.mark.timeout(120)
def test_chunk_larger_than_the_cache_is_fetched_once(tmp_path: Path, mount_factory):
    files = _write(tmp_path / "src")
    dest = prep_cli(tmp_path / "src", tmp_path / "dest", "-p", "2", "--chunk-mib", str(CHUNK_MIB))
    # 256 KiB of blob cache: no chunk fits. Sequential readers take whole blobs (the frame
    # cache, of a fixed size, serves partial reads of framed blobs only).
    m = mount_factory(dest, env={"FANSTORE_CACHE_BYTES": str(256 << 10)})

    def fetches() -> int:
        return int(status_ranks(m.status())[0]["stats"]["local_reads"])

    for name, want in files.items():
        before = fetches()
        assert _read(os.path.join(m.path, name), len(want)) == want
        assert fetches() - before == _chunks(len(want)), name  # one fetch per chunk
    # two sequential readers interleaved, request by request: each keeps its own chunk
    paths = {n: os.path.join(m.path, n) for n in files}
    fds = {n: os.open(p, os.O_RDONLY) for n, p in paths.items()}
    try:
        for fd in fds.values():
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        got: dict[str, list[bytes]] = {n: [] for n in files}
        before = fetches()
        for off in range(0, max(map(len, files.values())), STEP):
            for n, fd in fds.items():
                got[n].append(os.pread(fd, STEP, off))
        assert {n: b"".join(v) for n, v in got.items()} == files
        assert fetches() - before <= sum(_chunks(len(w)) for w in files.values())
    finally:
        for fd in fds.values():
            os.close(fd)


async def test_blob_cache_keeps_the_last_big_blobs():
    """In process: blobs over the limit stay in BIG_SLOTS slots beside the LRU, oldest out."""
    fetched: list[int] = []

    async def fetch(key) -> bytes:
        fetched.append(key)
        await trio.sleep(0)
        return bytes([key]) * (100 if key < 10 else 1000)

    cache = BlobCache(fetch, Stats(), limit=250)
    slots = BlobCache.BIG_SLOTS
    assert slots >= 3  # two readers' chunks, and one read ahead past a chunk's end
    big = list(range(11, 11 + slots))  # as many big blobs as there are slots
    for key in (1, big[0], 1, big[0], 2, 3, *big[1:], big[0], big[-1]):  # small: LRU; big: slots
        assert await cache.get(key) == bytes([key]) * (100 if key < 10 else 1000)
    assert fetched == [1, big[0], 2, 3, *big[1:]]
    await cache.get(99)  # one big blob more pushes out the least recently used (big[1])
    assert all(cache.peek(k) for k in (big[0], *big[2:], 99)) and not cache.peek(big[1])
    assert cache.peek(2) and cache.peek(3) and not cache.peek(1)  # the LRU kept 250 bytes
