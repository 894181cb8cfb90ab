"""Domain errors. Each carries the errno a reader sees; only `_fuse_ops` turns them into FUSEError."""

from __future__ import annotations

import errno


class FanstoreError(Exception):
    """Base class: a clear, one-line message and the errno a reader would see."""

    errno: int = errno.EIO

    def about(self, what: str) -> FanstoreError:
        """A new error with `what` (the call, the file) in front of this one's message and the
        same errno (this one may be shared: every reader of a failed blob gets it)."""
        err = FanstoreError(f"{what}: {self}")
        err.errno = self.errno
        return err


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
    """No such extended attribute."""

    errno = errno.ENODATA


class AccessDenied(FanstoreError):
    errno = errno.EACCES


class PeerError(FanstoreError):
    """A remote node did not answer in time or answered with an error."""

    errno = errno.EIO


class Exists(FanstoreError):
    errno = errno.EEXIST


class IsADirectory(FanstoreError):
    errno = errno.EISDIR


class NotEmpty(FanstoreError):
    errno = errno.ENOTEMPTY


class NoSpace(FanstoreError):
    """The local disk is full (ENOSPC from the OS). Earlier data is untouched."""

    errno = errno.ENOSPC


class QuotaExceeded(FanstoreError):
    """The write quota (``--write-quota``) would be exceeded."""

    errno = errno.EDQUOT


class BadHandle(FanstoreError):
    errno = errno.EBADF


class InvalidArgument(FanstoreError):
    errno = errno.EINVAL


class NotPermitted(FanstoreError):
    """Changing an entry only its writer (another rank) may change, or its owner."""

    errno = errno.EPERM


class CrossDevice(FanstoreError):
    """A hard link between the dataset and written entries, or to another rank's file: the
    caller (cp, tar, rsync) copies instead."""

    errno = errno.EXDEV


class Unsupported(FanstoreError):
    """A call the file system answers with an errno of its choosing (ENOSYS, ENODATA...)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.errno = code


class NotCommitted(FanstoreError):
    """The file was never closed/fsync'd: there is no committed version to export."""

    errno = errno.ENOENT


class NameTooLong(FanstoreError):
    errno = errno.ENAMETOOLONG


def os_error(e: OSError, what: str) -> FanstoreError:
    """An OSError as a domain error with the same errno (ENOSPC, EDQUOT get their own class)."""
    if e.errno == errno.ENOSPC:
        return NoSpace(f"{what}: no space left on the local disk")
    if e.errno == errno.EDQUOT:
        return QuotaExceeded(f"{what}: disk quota exceeded")
    err = FanstoreError(f"{what}: {e.strerror or e}")
    err.errno = e.errno or errno.EIO
    return err
