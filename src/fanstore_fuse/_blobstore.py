"""Read verified blob bytes from node-local partition files (blocking; call off the event loop)."""

from __future__ import annotations

import logging
import os
import threading
from array import array
from bisect import bisect_left
from collections import OrderedDict
from dataclasses import dataclass

from ._blobcodec import BlobCodec, Buffer, FrameTable, decode_frame, parse_table, table_bytes_needed
from ._errors import ChecksumError
from ._format import CODEC_FRAMED, Manifest, checksum
from ._fsio import CachedReads
from ._warmup import PartitionWarmup

log = logging.getLogger("fanstore_fuse.blobs")
MAX_TABLES = 4096  # verified frame tables kept (a 4 MiB blob's: ~4 KiB at 16 KiB frames)
_TABLE_PROBE = 4096  # first read of a frame table; a longer table takes a second read


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
        self._cached = CachedReads()
        self._lock = threading.Lock()
        self._tables: OrderedDict[int, FrameTable] = OrderedDict()
        self._tlock = threading.Lock()
        self.warmup: PartitionWarmup | None = None  # told of reads that miss the page cache

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

    def _pread(self, blob: int, n: int, off: int) -> bytes:
        try:
            data = os.pread(self._fd(self._part[blob]), n, off)
        except OSError as e:
            raise ChecksumError(f"{self.where(blob)}: read failed: {e.strerror}") from None
        if len(data) != n:
            raise ChecksumError(f"{self.where(blob)}: partition truncated")
        return data

    def _pread_nowait(self, blob: int, n: int, off: int) -> bytearray | None:
        """`n` bytes at `off` if the page cache has them all (RWF_NOWAIT), else None at once."""
        buf = bytearray(n)
        part = self._part[blob]
        fd = self._fd(part)
        try:
            hit = self._cached.readinto(fd, buf, off)
        except OSError as e:
            raise ChecksumError(f"{self.where(blob)}: read failed: {e.strerror}") from None
        if not hit and self.warmup is not None and self._cached.supported:
            self.warmup.miss(part, fd)
        return buf if hit else None  # the buffer itself: a copy costs as much as the read

    def stored(self, blob: int) -> bytes:
        return self._pread(blob, self._stored[blob], self._offset(blob))

    def stored_if_cached(self, blob: int) -> bytearray | None:
        """The stored bytes if the page cache has them all (RWF_NOWAIT), else None at once:
        lets the event loop read hot blobs inline and send cold ones to a thread."""
        return self._pread_nowait(blob, self._stored[blob], self._offset(blob))

    # ------------------------------------------------------------ framed blobs (codec 3)

    def codec_of(self, blob: int) -> int:
        return self._codec[blob]

    def known_table(self, blob: int) -> FrameTable | None:
        """The verified frame table of a framed blob if already read, else None (no I/O)."""
        with self._tlock:
            t = self._tables.get(blob)
            if t is not None:
                self._tables.move_to_end(blob)
            return t

    def table(self, blob: int) -> FrameTable:
        """The frame table of a framed blob, checked against the manifest's digest (blocking)."""
        t = self.known_table(blob)
        if t is not None:
            return t
        n, off, where = self._stored[blob], self._offset(blob), self.where(blob)
        head = self._pread(blob, min(n, _TABLE_PROBE), off)
        need = table_bytes_needed(head, n, where, self._raw[blob])
        if need > len(head):
            head = self._pread(blob, need, off)
        t = parse_table(head, n, self._raw[blob], self._xxh[blob], where)
        with self._tlock:
            self._tables[blob] = t
            while len(self._tables) > MAX_TABLES:
                self._tables.popitem(last=False)
        return t

    def _decode_frames(
        self, blob: int, t: FrameTable, k0: int, k1: int, data: bytes | bytearray
    ) -> list[bytes]:
        mv, base, where = memoryview(data), t.offsets[k0], self.where(blob)
        o = t.offsets
        return [
            decode_frame(t, k, mv[o[k] - base : o[k + 1] - base], where) for k in range(k0, k1 + 1)
        ]

    def frames(self, blob: int, k0: int, k1: int) -> list[bytes]:
        """Frames k0..k1 of a framed blob, read with one pread, each verified (blocking)."""
        t = self.table(blob)
        rel, n = t.span(k0, k1)
        return self._decode_frames(blob, t, k0, k1, self._pread(blob, n, self._offset(blob) + rel))

    def _raw_slice(
        self, blob: int, t: FrameTable, k0: int, k1: int, lo: int, hi: int, data: bytes | bytearray
    ) -> Buffer:
        """Bytes lo..hi of the blob from the stored bytes of raw frames k0..k1 (read for this
        call alone), each frame's xxh3 checked first: a view, no copy."""
        mv, o = memoryview(data), t.offsets
        base = o[k0]
        for k in range(k0, k1 + 1):
            if checksum(mv[o[k] - base : o[k + 1] - base]) != t.digests[k]:
                raise ChecksumError(f"{self.where(blob)}: frame {k} xxh3 checksum mismatch")
        a = lo - k0 * t.frame_size
        return data if a == 0 and hi - lo == len(data) else mv[a : a + hi - lo]

    def raw_range(self, blob: int, k0: int, k1: int, lo: int, hi: int) -> Buffer:
        """Bytes lo..hi of a framed blob whose frames k0..k1 (covering them) are stored raw:
        one pread of those frames, each verified (blocking)."""
        t = self.table(blob)
        rel, n = t.span(k0, k1)
        data = self._pread(blob, n, self._offset(blob) + rel)
        return self._raw_slice(blob, t, k0, k1, lo, hi, data)

    def raw_range_if_cached(
        self, blob: int, t: FrameTable, k0: int, k1: int, lo: int, hi: int
    ) -> Buffer | None:
        rel, n = t.span(k0, k1)
        data = self._pread_nowait(blob, n, self._offset(blob) + rel)
        return None if data is None else self._raw_slice(blob, t, k0, k1, lo, hi, data)

    def frames_if_cached(self, blob: int, t: FrameTable, k0: int, k1: int) -> list[bytes] | None:
        """`frames` without waiting on the disk: None when the bytes are not in the page cache."""
        rel, n = t.span(k0, k1)
        data = self._pread_nowait(blob, n, self._offset(blob) + rel)
        return None if data is None else self._decode_frames(blob, t, k0, k1, data)

    def stored_into(self, blob: int, buf: memoryview, nowait: bool = False) -> bool:
        """Read the stored bytes of `blob` into `buf` (exactly its stored size), no extra copy.
        With `nowait`, only from the page cache (RWF_NOWAIT): False at once if it would wait."""
        part = self._part[blob]
        fd, off = self._fd(part), self._offset(blob)
        try:
            if nowait or self.warmup is not None:  # a miss is what the warm-up waits for
                if self._cached.readinto(fd, buf, off):
                    return True
                if self.warmup is not None and self._cached.supported:
                    self.warmup.miss(part, fd)
                if nowait:
                    return False
            n = os.preadv(fd, [buf], off)
        except OSError as e:
            raise ChecksumError(f"{self.where(blob)}: read failed: {e.strerror}") from None
        if n != len(buf):
            raise ChecksumError(f"{self.where(blob)}: partition truncated")
        return True

    def decode(self, blob: int, stored: Buffer) -> Buffer:
        """Decode and verify bytes that claim to be `blob` (local or from a peer): their length
        must be the manifest's stored size before anything is decoded."""
        if len(stored) != self._stored[blob]:
            raise ChecksumError(f"{self.where(blob)}: {len(stored)} stored bytes, the manifest "
                                f"says {self._stored[blob]}")
        return self.codec.decode(
            stored, self._codec[blob], self._raw[blob], self._xxh[blob], self.where(blob)
        )

    def raw(self, blob: int) -> Buffer:
        if self._codec[blob] == CODEC_FRAMED:
            t = self.table(blob)
            if not any(t.zstd):  # raw sub-blocks: read them as they lie, check, no copy
                return self.raw_range(blob, 0, t.count - 1, 0, t.raw_len)
        return self.decode(blob, self.stored(blob))

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
