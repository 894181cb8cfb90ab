"""Shared by the tests/test_writes_*.py files: one write store call and its errno, whole files in
and out."""

from __future__ import annotations

from fanstore_fuse._errors import FanstoreError
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
