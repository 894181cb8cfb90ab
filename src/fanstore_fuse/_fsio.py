"""Small file-system helpers every module shares: atomic replacement of a file, directory fsync,
reads served only from the page cache."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
from typing import Any

from ._safepath import open_private


def fsync_dir(path: str) -> None:
    """Make a directory's entries durable (best effort: some file systems refuse)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class CachedReads:
    """`preadv` with `RWF_NOWAIT`: fill a buffer only from the page cache, never waiting on the
    disk, so an event loop can read hot data inline and send cold reads to a thread. One per
    file system a caller reads: a file system that refuses the flag turns it off for good."""

    def __init__(self) -> None:
        self.supported = hasattr(os, "RWF_NOWAIT")

    def readinto(self, fd: int, buf: bytearray | memoryview, off: int) -> bool:
        """True if all of `buf` came from the page cache; False at once if any of it would
        wait on the disk (or the flag is unsupported). Other errors raise OSError."""
        if not self.supported:
            return False
        try:
            n = os.preadv(fd, [buf], off, os.RWF_NOWAIT)
        except BlockingIOError:
            return False
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            self.supported = False
            return False
        return n == len(buf)  # partly cached (or short): a blocking read will tell


def write_all(fd: int, data: bytes | memoryview) -> None:
    """os.write until every byte is written (a write may be short)."""
    mv = memoryview(data)
    while mv:
        mv = mv[os.write(fd, mv) :]


def atomic_write(path: str, data: bytes | str, durable: bool = True) -> None:
    """Replace `path` with `data` all at once: a private (0600) temporary name in the same
    directory, opened as `_safepath.open_private` does (never through a symlink, never another
    user's file), then rename. A reader sees the old file or the new one, never a part. With
    `durable` the bytes and the rename are fsync'd."""
    raw = data.encode() if isinstance(data, str) else data
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            write_all(fd, raw)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def untouched_zeros(n: int, dtype: Any) -> Any:
    """A zero-filled numpy array of `n` items in its own anonymous mapping: its pages cost no
    memory until written. (`np.zeros` may get a reused heap block from calloc, which clears it
    and so makes every page resident: 10 MB for a per-blob index at 1.28M blobs.)"""
    import numpy as np

    dt = np.dtype(dtype)
    return np.frombuffer(mmap.mmap(-1, max(1, n * dt.itemsize)), dtype=dt, count=n)


def name_this_thread() -> None:
    """Give the calling thread its `threading` name in the OS too (/proc/thread-self/comm, 15
    bytes), so that `top -H`, `ps -L`, py-spy and `bench.cost` tell a daemon's threads apart
    (the interpreter leaves them all named after the process)."""
    with contextlib.suppress(OSError), open("/proc/thread-self/comm", "w") as f:
        f.write(threading.current_thread().name[:15])
