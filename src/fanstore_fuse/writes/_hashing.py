"""The xxh3-64 of written files: whole-file and per-CHUNK digests, shared with stage-out."""

from __future__ import annotations

import os
from collections.abc import Callable

import xxhash

from .._errors import ChecksumError
from .._format import HASH_SEED

CHUNK = 4 << 20  # granularity of the per-chunk checksums (remote reads are verified per chunk)


class Hasher:
    """Whole-file and (with `chunked`) per-chunk xxh3 of a stream of appended bytes."""

    __slots__ = ("whole", "part", "part_len", "chunks", "pos", "chunked")

    def __init__(self, chunked: bool = True) -> None:
        self.whole = xxhash.xxh3_64(seed=HASH_SEED)
        self.part = xxhash.xxh3_64(seed=HASH_SEED)
        self.part_len = 0
        self.chunks: list[int] = []
        self.pos = 0
        self.chunked = chunked

    def update(self, data: bytes | memoryview) -> None:
        mv = memoryview(data)
        self.whole.update(mv)
        self.pos += len(mv)
        while self.chunked and len(mv):
            take = min(len(mv), CHUNK - self.part_len)
            self.part.update(mv[:take])
            self.part_len += take
            mv = mv[take:]
            if self.part_len == CHUNK:
                self.chunks.append(self.part.intdigest())
                self.part = xxhash.xxh3_64(seed=HASH_SEED)
                self.part_len = 0

    def digest(self) -> tuple[int, list[int]]:
        chunks = list(self.chunks)
        if self.chunked and (self.part_len or not chunks):
            chunks.append(self.part.intdigest())
        return self.whole.intdigest(), chunks


def hash_file(fd: int, size: int, chunked: bool = True,
              sink: Callable[[bytes], object] | None = None) -> tuple[int, list[int]]:
    """(xxh3, chunk xxh3s) of the first `size` bytes of an open file; each piece read is also
    handed to `sink` (stage-out copies while it hashes). ChecksumError if the file is shorter."""
    h = Hasher(chunked)
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
