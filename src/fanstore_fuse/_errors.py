"""Domain errors. Each carries the errno the FUSE layer reports; only `_fuse_ops` maps them."""

from __future__ import annotations

import errno


class FanstoreError(Exception):
    """Base class: a clear, one-line message and the errno a reader would see."""

    errno: int = errno.EIO


class FormatError(FanstoreError):
    """A manifest or partition is malformed, from another version, or fails its checksum."""

    errno = errno.EIO


class ChecksumError(FanstoreError):
    """A blob's bytes do not match their recorded xxh3-64: never hand them to a reader."""

    errno = errno.EIO


class NotFound(FanstoreError):
    errno = errno.ENOENT


class NotADirectory(FanstoreError):
    errno = errno.ENOTDIR


class ReadOnly(FanstoreError):
    errno = errno.EROFS


class NoData(FanstoreError):
    errno = errno.ENODATA


class PeerError(FanstoreError):
    """A remote node did not answer in time or answered with an error."""

    errno = errno.EIO
