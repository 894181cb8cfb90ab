"""Read verified blob bytes from node-local partition files (blocking; call off the event loop)."""

from __future__ import annotations

import errno
import logging
import os
import threading
from array import array
from bisect import bisect_left
from dataclasses import dataclass

from ._errors import ChecksumError
from ._format import BlobCodec, Manifest

log = logging.getLogger("fanstore_fuse.blobs")


@dataclass
class DenseMap:
    """Where a rank's blobs lie in its densely packed local copies of the partitions in
    `parts`: blob `ids[k]` (ascending) is at local offset `offs[k]`. Other partitions are whole
    copies (same offsets as DEST)."""

    ids: array
    offs: array
    parts: frozenset[int]

    def offset(self, blob: int) -> int | None:
        k = bisect_left(self.ids, blob)
        return self.offs[k] if k < len(self.ids) and self.ids[k] == blob else None


class BlobStore:
    """Blob id -> verified raw bytes, from partition files under `local_dir`.

    `stored(blob)` returns the bytes as stored (what a remote peer is sent); `raw(blob)`
    returns decoded, checksum-verified bytes. Missing or short partitions raise ChecksumError.
    """

    def __init__(self, manifest: Manifest, local_dir: str, dense: DenseMap | None = None):
        self.m = manifest
        self.local_dir = local_dir
        self.dense = dense
        self.codec = BlobCodec(manifest.zdict)
        b = manifest.blobs
        self._part, self._off, self._stored = b["part"], b["offset"], b["stored"]
        self._raw, self._codec, self._xxh = b["raw"], b["codec"], b["xxh3"]
        self._fds: dict[int, int] = {}
        self._nowait = hasattr(os, "RWF_NOWAIT")
        self._lock = threading.Lock()

    def where(self, blob: int) -> str:
        p = self._part[blob]
        return f"blob {blob} (partition {self.m.partitions[p].name}, offset {self._off[blob]})"

    def _offset(self, blob: int) -> int:
        d = self.dense
        if d is None or self._part[blob] not in d.parts:
            return self._off[blob]
        off = d.offset(blob)
        if off is None:
            raise ChecksumError(f"{self.where(blob)}: not held in this rank's local copy")
        return off

    def stored_size(self, blob: int) -> int:
        return self._stored[blob]

    def raw_size(self, blob: int) -> int:
        return self._raw[blob]

    def _fd(self, part: int) -> int:
        fd = self._fds.get(part)
        if fd is None:
            with self._lock:
                fd = self._fds.get(part)
                if fd is None:
                    path = os.path.join(self.local_dir, self.m.partitions[part].name)
                    try:
                        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                    except OSError as e:
                        raise ChecksumError(
                            f"partition {self.m.partitions[part].name} unreadable: {e.strerror}"
                        ) from None
                    self._fds[part] = fd
        return fd

    def stored(self, blob: int) -> bytes:
        n = self._stored[blob]
        try:
            data = os.pread(self._fd(self._part[blob]), n, self._offset(blob))
        except OSError as e:
            raise ChecksumError(f"{self.where(blob)}: read failed: {e.strerror}") from None
        if len(data) != n:
            raise ChecksumError(f"{self.where(blob)}: partition truncated")
        return data

    def stored_if_cached(self, blob: int) -> bytes | None:
        """The stored bytes if the page cache has them all (RWF_NOWAIT), else None at once:
        lets the event loop read hot blobs inline and send cold ones to a thread."""
        if not self._nowait:
            return None
        n = self._stored[blob]
        buf = bytearray(n)
        try:
            k = os.preadv(self._fd(self._part[blob]), [buf], self._offset(blob), os.RWF_NOWAIT)
        except BlockingIOError:
            return None
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                self._nowait = False
                return None
            raise ChecksumError(f"{self.where(blob)}: read failed: {e.strerror}") from None
        return bytes(buf) if k == n else None

    def stored_into(self, blob: int, buf: memoryview, nowait: bool = False) -> bool:
        """Read the stored bytes of `blob` into `buf` (exactly its stored size), no extra copy.
        With `nowait`, only from the page cache (RWF_NOWAIT): False at once if it would wait."""
        if nowait and not self._nowait:
            return False
        try:
            n = os.preadv(self._fd(self._part[blob]), [buf], self._offset(blob),
                          os.RWF_NOWAIT if nowait else 0)
        except BlockingIOError:
            return False
        except OSError as e:
            if nowait and e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                self._nowait = False
                return False
            raise ChecksumError(f"{self.where(blob)}: read failed: {e.strerror}") from None
        if n != len(buf):
            if nowait:
                return False  # partly cached: the blocking read tells a short partition apart
            raise ChecksumError(f"{self.where(blob)}: partition truncated")
        return True

    def decode(self, blob: int, stored: bytes | memoryview) -> bytes:
        """Decode and verify bytes that claim to be `blob` (local or from a peer)."""
        return self.codec.decode(
            stored, self._codec[blob], self._raw[blob], self._xxh[blob], self.where(blob)
        )

    def raw(self, blob: int) -> bytes:
        return self.decode(blob, self.stored(blob))

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
