"""Shared by the tests/test_writes_*.py files: one write store call and its errno, whole files in
and out."""

from __future__ import annotations

import struct

from fanstore_fuse._errors import FanstoreError
from fanstore_fuse._format import checksum
from fanstore_fuse.writes import WriteStore


def errno_of(fn, *args, **kw) -> int:
    try:
        fn(*args, **kw)
    except FanstoreError as e:
        return e.errno
    raise AssertionError("no error raised")


def put(s: WriteStore, path: str, data: bytes) -> None:
    fh, _ = s.create(path)
    s.write(fh, 0, data)
    s.close(fh)


def content(s: WriteStore, path: str) -> bytes:
    fh = s.open(path)
    try:
        return s.read(fh, 0, 1 << 40)
    finally:
        s.close(fh)


def file_digests(data: bytes, chunk: int = 4 << 20) -> tuple[int, list[int]]:
    """What a commit of `data` records, computed here without the store's code: the xxh3 of
    each `chunk`-sized piece (one, of nothing, for an empty file) and the file's digest, the
    xxh3 of those digests as little-endian u64s."""
    chunks = [checksum(data[i:i + chunk]) for i in range(0, len(data), chunk)] or [checksum(b"")]
    return checksum(struct.pack(f"<{len(chunks)}Q", *chunks)), chunks


def file_digest(data: bytes) -> int:
    return file_digests(data)[0]
