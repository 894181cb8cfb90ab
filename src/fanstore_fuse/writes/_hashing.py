"""The xxh3-64 digests of written files, shared with stage-out: one per CHUNK-sized piece
(remote reads verify those), and the file's digest, the xxh3 of its chunk digests (8 bytes
each, little-endian) so that a file changed in a few places is hashed again only there
(`rehash_chunks`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence

import xxhash

from .._errors import ChecksumError
from .._format import HASH_SEED, checksum

CHUNK = 4 << 20  # granularity of the per-chunk checksums (remote reads are verified per chunk)


def whole_digest(chunks: Sequence[int]) -> int:
    """A file's digest: the xxh3 of its chunk digests, 8 bytes each, little-endian."""
    return checksum(b"".join(c.to_bytes(8, "little") for c in chunks))


def chunk_count(size: int) -> int:
    """Chunks of a file of `size` bytes (an empty file has one, the digest of nothing)."""
    return max(1, -(-size // CHUNK))


def chunks_touched(lo: int, hi: int) -> range:
    """The chunks that bytes [lo, hi) fall in."""
    return range(lo // CHUNK, (hi - 1) // CHUNK + 1) if hi > lo else range(0)


class Hasher:
    """Per-chunk xxh3 of a stream of appended bytes."""

    __slots__ = ("part", "part_len", "chunks", "pos")

    def __init__(self) -> None:
        self.part = xxhash.xxh3_64(seed=HASH_SEED)
        self.part_len = 0
        self.chunks: list[int] = []
        self.pos = 0

    def update(self, data: bytes | memoryview) -> None:
        mv = memoryview(data)
        self.pos += len(mv)
        while len(mv):
            take = min(len(mv), CHUNK - self.part_len)
            self.part.update(mv[:take])
            self.part_len += take
            mv = mv[take:]
            if self.part_len == CHUNK:
                self.chunks.append(self.part.intdigest())
                self.part = xxhash.xxh3_64(seed=HASH_SEED)
                self.part_len = 0

    def digest(self) -> tuple[int, list[int]]:
        """(the file's digest, its chunk digests)."""
        chunks = list(self.chunks)
        if self.part_len or not chunks:
            chunks.append(self.part.intdigest())
        return whole_digest(chunks), chunks


def hash_file(fd: int, size: int,
              sink: Callable[[bytes], object] | None = None) -> tuple[int, list[int]]:
    """(digest, chunk digests) of the first `size` bytes of an open file; each piece read is
    also handed to `sink` (stage-out copies while it hashes). ChecksumError if the file is
    shorter."""
    h = Hasher()
    off = 0
    while off < size:
        data = os.pread(fd, min(CHUNK, size - off), off)
        if not data:
            raise ChecksumError(f"data file is shorter ({off} bytes) than its recorded size {size}")
        h.update(data)
        if sink is not None:
            sink(data)
        off += len(data)
    return h.digest()


def rehash_chunks(fd: int, size: int, old_size: int, old: Sequence[int],
                  changed: Iterable[int]) -> tuple[int, list[int]]:
    """(digest, chunk digests) of the first `size` bytes of an open file whose digests were
    `old` (of `old_size` bytes) before the chunks in `changed` changed: only those, the
    chunks past the old end and, if the size changed, the old and new last chunks are read
    and hashed again. ChecksumError if the file is shorter."""
    n = chunk_count(size)
    chunks = list(old[:n]) + [0] * max(0, n - len(old))
    redo = {i for i in changed if i < n} | set(range(min(len(old), n), n))
    if size != old_size:
        redo |= {i for i in (len(old) - 1, n - 1) if 0 <= i < n}
    for i in sorted(redo):
        want = min(CHUNK, size - i * CHUNK)
        data = os.pread(fd, want, i * CHUNK) if want else b""
        if len(data) != want:
            raise ChecksumError(f"data file is shorter than its recorded size {size}")
        chunks[i] = checksum(data)
    return whole_digest(chunks), chunks
