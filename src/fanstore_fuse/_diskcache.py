"""Blobs fetched from other ranks, kept on the node's local disk (after ORNL's HVAC).

The second epoch of a job reads what the first fetched over the network from the local disk.
Layout: `LOCAL/cache/seg-NNNNNNNNNNNN.fsc`, a ring of append-only segment files, each a 64-byte
header (magic `FSCACHE\\0`, version, segment number) followed by entries back to back, each
the xxh3 of the blob's raw (decoded) bytes (8 bytes, little-endian) and then those bytes. The
index is memory only: one `uint64` per dataset blob (`segment << 40 | offset`, 0 = absent; a
zero-filled numpy array, so untouched pages cost nothing) plus one small object per segment. A
blob's length is the manifest's `raw`; its checksum, stored with the entry, is the manifest's
`xxh3` where that covers the raw bytes (codecs raw, zstd and zstd with a dictionary: `raw_digest`)
and else computed by the writer thread from the verified bytes the holder sent (the manifest's
`xxh3` of a framed blob covers its frame table, not the raw bytes). The cache lives as
long as its daemon; `umount` removes it with the local dir.

- **Reads** verify every time (length + the entry's xxh3 of the raw bytes): a mismatch
  or a read error drops the entry and the caller fetches the blob again from its holder, so a
  damaged cache never hands out wrong bytes. `read(blob, nowait=True)` uses `RWF_NOWAIT` so the
  event loop reads page-cached entries inline and sends the rest to a thread (`BLOCKED`).
- **Writes** never block the caller: `put` queues the bytes (bounded; past the bound a blob is
  simply not cached) and one writer thread appends batches with `pwritev`, then publishes the
  entries. A segment in use is pinned; eviction unlinks it and closes it when the last reader
  is done, so an fd is never reused under a reader.
- **Eviction** is FIFO by segment: when the cache is over its limit the oldest segment file
  goes, with every entry in it (an epoch reads everything once, so age is as good as recency).
- **Disk full / I/O errors** on a write never fail a read: ENOSPC or EDQUOT shrinks the limit to
  what the cache holds (logged once; off when that is under one segment), any other error turns
  the cache off. The reader already has its bytes.

No trio, FUSE or MPI here; `_compose.CachingBlobSource` puts it in front of a rank's blob source.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np

from ._blobcodec import Buffer
from ._errors import FanstoreError
from ._format import CODEC_FRAMED, checksum
from ._fsio import CachedReads, name_this_thread, untouched_zeros
from ._safepath import open_private
from ._settings import parse_cache_size

log = logging.getLogger("fanstore_fuse.diskcache")

MAGIC: Final = b"FSCACHE\0"
VERSION: Final = 2
ENTRY_HEADER: Final = 8  # the xxh3 (little-endian u64) in front of each entry
_DIGEST = struct.Struct("<Q")
HEADER = struct.Struct("<8sHHIQ")  # magic, version, flags, reserved, segment number
DATA_START: Final = 64  # the header padded to 64 bytes; blobs start here
CACHE_DIR: Final = "cache"
_OFF_BITS: Final = 40  # offsets within a segment < 1 TiB
_OFF_MASK: Final = (1 << _OFF_BITS) - 1
BLOCKED: Final = object()  # `read(nowait=True)`: the bytes are not in the page cache
QUEUE_BYTES: Final = 64 << 20  # bytes waiting for the writer thread at most
_BATCH_BYTES: Final = 16 << 20
_BATCH_ITEMS: Final = 512  # entries of one pwritev: two iovecs each (IOV_MAX is 1024)


def segment_header(number: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, 0, 0, number).ljust(DATA_START, b"\0")


def read_segment_header(data: bytes) -> int:
    """The segment number of a segment file's first bytes; FanstoreError if not one of ours."""
    if len(data) < DATA_START:
        raise FanstoreError("cache segment: short header")
    magic, version, flags, _, number = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise FanstoreError("cache segment: bad magic")
    if version != VERSION or flags:
        raise FanstoreError(f"cache segment: version {version} flags {flags}, expected {VERSION} 0")
    return int(number)


def resolve_limit(spec: str, path: str) -> int:
    """Bytes for a `--cache-size` spec: a size, or a share of the free space at `path`."""
    size, share = parse_cache_size(spec)
    if size is not None:
        return size
    st = os.statvfs(path)
    return int(st.f_bavail * st.f_frsize * (share or 0.0))


def segment_bytes_for(limit: int) -> int:
    """Segments of 1/16 of the cache, between 1 MiB and 256 MiB, never over the limit (FIFO
    eviction granularity)."""
    return max(1, min(limit, max(1 << 20, min(256 << 20, limit // 16))))


def _clear(directory: str) -> None:
    """Make the cache directory (0700), removing segments a killed daemon may have left."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    for name in os.listdir(directory):
        if name.startswith("seg-") and name.endswith(".fsc"):
            os.unlink(os.path.join(directory, name))


class _Segment:
    __slots__ = ("number", "fd", "path", "size", "entries", "pins", "doomed")

    def __init__(self, number: int, fd: int, path: str):
        self.number = number
        self.fd = fd
        self.path = path
        self.size = DATA_START
        self.entries = 0
        self.pins = 0
        self.doomed = False


def manifest_raw_digest(blobs: Any) -> Callable[[int], int | None]:
    """`DiskCache`'s `raw_digest` from a manifest's blob columns: the blob's `xxh3` where it is
    the xxh3 of the raw bytes (every codec but framed, docs/format.md), else None."""
    codecs, digests = blobs["codec"], blobs["xxh3"]

    def raw_digest(blob: int) -> int | None:
        return None if codecs[blob] == CODEC_FRAMED else int(digests[blob])

    return raw_digest


class DiskCache:
    """Verified raw blob bytes on local disk, bounded by `limit` bytes (module docstring).

    `sizes[b]` is the manifest's raw length of blob `b`; `raw_digest(b)`, where given, the xxh3
    of its raw bytes if the manifest has it (None: the writer computes it)."""

    def __init__(
        self, directory: str, limit: int, sizes: Sequence[int],
        segment_bytes: int | None = None, queue_bytes: int = QUEUE_BYTES,
        raw_digest: Callable[[int], int | None] | None = None,
    ):
        self.dir = directory
        self.limit = limit
        self.segment_bytes = segment_bytes or segment_bytes_for(limit)
        self._sizes = sizes
        self._raw_digest = raw_digest
        self._loc = untouched_zeros(len(sizes), np.uint64)  # pages cost only once written
        self._segs: dict[int, _Segment] = {}  # live segments, oldest first (insertion order)
        self._next = 1
        self._lock = threading.Lock()
        self._cached = CachedReads()
        self.bytes = 0  # file bytes of the live segments (headers included)
        self.entries = 0
        self.hits = self.misses = self.evictions = self.corrupt = self.skipped = 0
        self.written = 0
        self.disabled = limit <= 0
        self._full_logged = False
        self._queue: queue.SimpleQueue[tuple[int, Buffer] | None] = queue.SimpleQueue()
        self._queued = 0  # bytes in the queue
        # blobs queued and not yet written: readable from here, so a blob that leaves the memory
        # cache before the writer reached it is not fetched from its owner a second time
        self._pending: dict[int, Buffer] = {}
        self._qlock = threading.Lock()
        self._queue_bytes = queue_bytes
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None
        if not self.disabled:
            try:
                _clear(directory)
            except OSError as e:  # a cache we cannot set up is no cache, not a failed mount
                log.warning("disk cache: cannot use %s (%s); no disk cache", directory, e.strerror)
                self.disabled, self.limit = True, 0
                return
            self._thread = threading.Thread(target=self._writer, name="fanstore-diskcache",
                                            daemon=True)
            self._thread.start()

    # ------------------------------------------------------------ reads

    def has(self, blob: int) -> bool:
        return bool(self._loc[blob]) or blob in self._pending

    def miss(self) -> None:
        """Count a lookup of a blob the cache does not have (the caller fetches it)."""
        self.misses += 1

    def read(self, blob: int, nowait: bool = False) -> Buffer | None | object:
        """The verified bytes of `blob`; None if not cached (any bad or unreadable entry is
        dropped first); `BLOCKED` with `nowait` when the page cache does not hold them all."""
        loc = int(self._loc[blob])
        if not loc:
            data = self._pending.get(blob)  # verified when it was put, kept in memory since
            if data is not None:
                self.hits += 1
                return data
            self.misses += 1
            return None
        number, off = loc >> _OFF_BITS, loc & _OFF_MASK
        with self._lock:
            seg = self._segs.get(number)
            if seg is None:  # evicted since
                self._loc[blob] = 0
                self.misses += 1
                return None
            seg.pins += 1
        n = self._sizes[blob] + ENTRY_HEADER
        entry: bytes | bytearray | None
        try:
            if nowait:
                entry = self._read_nowait(seg.fd, n, off)
                if entry is None:
                    return BLOCKED
            else:
                entry = os.pread(seg.fd, n, off)
        except OSError as e:
            self._drop(blob, seg, f"read failed ({e.strerror})")
            return None
        finally:
            self._unpin(seg)
        got = len(entry)
        data = memoryview(entry)[ENTRY_HEADER:]  # a view: the entry was read for this blob alone
        if got != n or checksum(data) != _DIGEST.unpack_from(entry)[0]:
            self._drop(blob, seg, "xxh3 checksum mismatch" if got == n else "entry truncated")
            return None
        self.hits += 1
        return data

    def _read_nowait(self, fd: int, n: int, off: int) -> bytearray | None:
        """The bytes if the page cache holds them all, else None at once (RWF_NOWAIT)."""
        buf = bytearray(n)
        return buf if self._cached.readinto(fd, buf, off) else None

    def _unpin(self, seg: _Segment) -> None:
        with self._lock:
            seg.pins -= 1
            if seg.doomed and seg.pins == 0:
                os.close(seg.fd)

    def _drop(self, blob: int, seg: _Segment, why: str) -> None:
        log.warning("disk cache: blob %d (%s, offset %d): %s; dropped, fetching it again",
                    blob, os.path.basename(seg.path), int(self._loc[blob]) & _OFF_MASK, why)
        with self._lock:
            if self._loc[blob]:
                self._loc[blob] = 0
                seg.entries -= 1
                if not seg.doomed:
                    self.entries -= 1
        self.corrupt += 1
        self.misses += 1

    # ------------------------------------------------------------ writes

    def put(self, blob: int, data: Buffer) -> None:
        """Queue verified raw bytes of `blob` for the writer thread; never blocks, never fails."""
        n = len(data)
        with self._qlock:
            if self.disabled or n > self.limit or self._queued + n > self._queue_bytes:
                self.skipped += 1
                return
            self._queued += n
            self._idle.clear()
            self._pending[blob] = data
            self._queue.put((blob, data))

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued blob is written (or dropped); for tests and benchmarks."""
        return self._idle.wait(timeout)

    def _writer(self) -> None:
        name_this_thread()
        while True:
            item = self._queue.get()
            if item is None:
                self._idle.set()
                return
            batch, size = [item], len(item[1])
            while size < _BATCH_BYTES and len(batch) < _BATCH_ITEMS:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)
                    break
                batch.append(more)
                size += len(more[1])
            try:
                self._write(batch)
            except Exception:  # a bug here must not kill the writer silently
                log.exception("disk cache: writer failed; cache turned off")
                self._disable()
            with self._qlock:
                self._queued -= size
                for blob, _ in batch:  # written (its entry published) or dropped: not pending
                    self._pending.pop(blob, None)
                if self._queue.empty():
                    self._idle.set()

    def _write(self, batch: list[tuple[int, Buffer]]) -> None:
        """Append the batch, one `pwritev` per segment filled, then publish the entries."""
        seg, pending, psize, seen = None, [], 0, set()
        for blob, data in batch:
            if self.disabled:
                return
            if self._loc[blob] or blob in seen or len(data) > self.limit:
                continue
            seen.add(blob)
            if seg is None:
                try:
                    seg = self._current()
                except OSError as e:
                    self._write_failed(e)
                    return
            pending.append((blob, data))
            psize += ENTRY_HEADER + len(data)
            if seg.size + psize >= self.segment_bytes:  # full: the next blob opens a new one
                if not self._append(seg, pending):
                    return
                seg, pending, psize = None, [], 0
        if seg is not None and pending:
            self._append(seg, pending)

    def _current(self) -> _Segment:
        """The segment being appended to; a new one when it is full."""
        seg = next(reversed(self._segs.values())) if self._segs else None
        if seg is None or seg.size >= self.segment_bytes:
            number = self._next
            self._next += 1
            path = os.path.join(self.dir, f"seg-{number:012d}.fsc")
            fd = open_private(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
            seg = _Segment(number, fd, path)
            try:
                os.pwrite(fd, segment_header(number), 0)
            except OSError:
                os.close(fd)
                os.unlink(path)
                raise
            with self._lock:
                self._segs[number] = seg
                self.bytes += DATA_START
        return seg

    def _append(self, seg: _Segment, items: list[tuple[int, Buffer]]) -> bool:
        size = sum(ENTRY_HEADER + len(d) for _, d in items)
        iov: list[Buffer] = []
        for blob, d in items:
            known = self._raw_digest(blob) if self._raw_digest is not None else None
            iov += (_DIGEST.pack(checksum(d) if known is None else known), d)
        try:
            got = os.pwritev(seg.fd, iov, seg.size)
            if got != size:
                raise OSError(errno.ENOSPC, "short write")
        except OSError as e:
            self._write_failed(e)
            return False
        off = seg.size
        with self._lock:
            for blob, data in items:
                self._loc[blob] = (seg.number << _OFF_BITS) | off
                off += ENTRY_HEADER + len(data)
            seg.size = off
            seg.entries += len(items)
            self.entries += len(items)
            self.bytes += size
        self.written += size
        self._evict(self.limit)
        return True

    def _write_failed(self, e: OSError) -> None:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            limit = self.bytes - self.segment_bytes
            if not self._full_logged:
                self._full_logged = True
                log.warning("disk cache: local disk full (%s); limit %d -> %d bytes",
                            e.strerror, self.limit, max(limit, 0))
            if limit >= self.segment_bytes:
                self.limit = limit
                self._evict(limit)
                return
        else:
            log.warning("disk cache: write failed (%s); cache turned off", e.strerror)
        self._disable()

    def _disable(self) -> None:
        self.disabled = True
        self.limit = 0
        self._evict(-1)

    def _evict(self, limit: int) -> None:
        """Drop the oldest segments while over `limit` (the newest stays unless limit < 0)."""
        while self._segs and self.bytes > limit and (limit < 0 or len(self._segs) > 1):
            with self._lock:
                number = next(iter(self._segs))
                seg = self._segs.pop(number)
                self.bytes -= seg.size
                self.entries -= seg.entries
                self.evictions += seg.entries
                seg.doomed = True
                if seg.pins == 0:
                    os.close(seg.fd)
            try:
                os.unlink(seg.path)
            except OSError as e:
                log.warning("disk cache: cannot remove %s (%s)", seg.path, e.strerror)

    # ------------------------------------------------------------ status, close

    def status(self) -> dict[str, int]:
        """Counters: `hits` and `misses` count every read of a blob this rank does not hold."""
        return {"bytes": self.bytes, "entries": self.entries, "hits": self.hits,
                "misses": self.misses, "evictions": self.evictions, "corrupt": self.corrupt,
                "skipped": self.skipped, "written": self.written, "limit": self.limit,
                "disabled": int(self.disabled)}

    def close(self) -> None:
        """Stop the writer (what is still queued is dropped) and remove the segment files."""
        if self._thread is not None:
            self.disabled = True
            self._queue.put(None)
            self._thread.join(timeout=10)
            self._thread = None
        self._evict(-1)
