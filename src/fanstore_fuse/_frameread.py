"""Partial reads of framed blobs (codec 3) for a `Node`: a random read decodes only the
frames it covers; sequential readers keep taking whole blobs (see `sequential`).

Used when the node's blob source can read single frames (`LocalBlobSource`: blobs held on
this node); other sources fetch and decode whole blobs as before. Raw frames (sub-blocks of
incompressible data) are read straight from the partition, exactly the frames covering the
request, checked and sliced, never cached here (the page cache has them). Zstd frames are
cached decoded by (blob, frame) in their own byte-bounded `BlobCache`; concurrent readers of
one frame share one fetch, and a read of several missing frames fetches them with one pread.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Protocol

from ._blobcodec import Buffer, FrameTable
from ._format import CODEC_FRAMED
from ._node import BlobCache, Stats

log = logging.getLogger("fanstore_fuse.node")

_MAX_STREAMS = 1024  # files whose read position is remembered (sequential detection)
_NEAR = 128 << 10  # a read starting this close to the previous read's end is sequential
PROMOTE = 32  # frame reads of one blob after which the whole blob is fetched and cached


class FrameSource(Protocol):
    async def table(self, blob: int) -> FrameTable: ...

    async def fetch_frames(self, blob: int, k0: int, k1: int) -> list[bytes]: ...

    async def read_raw(self, blob: int, k0: int, k1: int, lo: int, hi: int) -> bytes: ...


class FrameReader:
    def __init__(
        self, source: FrameSource, codecs: Any, stats: Stats, limit: int,
        holds: Callable[[int], bool] | None = None,
    ):
        self.source = source
        self._codecs = codecs  # the manifest's codec column
        self._holds = holds  # None: every blob is local
        self.cache = BlobCache(self._fetch_one, stats, limit)
        # inode: (end of the last read, sequential reads in a row)
        self._streams: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self._reads: OrderedDict[int, int] = OrderedDict()  # blob: frame reads so far

    def usable(self, blob: int) -> bool:
        """A framed blob this node holds: read only the frames asked for."""
        return self._codecs[blob] == CODEC_FRAMED and (self._holds is None or self._holds(blob))

    async def _fetch_one(self, key: Hashable) -> bytes:
        assert isinstance(key, tuple)
        blob, k = key
        return (await self.source.fetch_frames(blob, k, k))[0]

    async def read(self, blob: int, lo: int, hi: int) -> Buffer:
        """Bytes lo..hi of `blob`, verified frame by frame."""
        t = await self.source.table(blob)
        fs = t.frame_size
        k0, k1 = lo // fs, (hi - 1) // fs
        if not any(t.zstd[k0 : k1 + 1]):
            return await self.source.read_raw(blob, k0, k1, lo, hi)
        if k0 != k1:
            await self._fill(blob, k0, k1)
        parts: list[Buffer] = []
        for k in range(k0, k1 + 1):
            data = await self.cache.get((blob, k))
            base = k * fs
            parts.append(memoryview(data)[max(lo, base) - base : min(hi, base + len(data)) - base])
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def _fill(self, blob: int, k0: int, k1: int) -> None:
        keys: list[Hashable] = [(blob, k) for k in range(k0, k1 + 1)]

        async def many(a: int, z: int) -> list[bytes]:
            return await self.source.fetch_frames(blob, k0 + a, k0 + z)

        await self.cache.fill(keys, many)

    # ------------------------------------------------------------ access pattern

    def promote(self, blob: int) -> bool:
        """Count a frame read of `blob`; True once it reached PROMOTE: a blob read this much
        at random is worth fetching whole into the node's blob cache (as a squashfs block cache
        would), so a hot file stops paying a disk read per request. The node promotes only while
        the cache has room without evicting, so a file larger than the cache is not thrashed."""
        n = self._reads.pop(blob, 0) + 1
        if n >= PROMOTE:
            return True
        self._reads[blob] = n
        if len(self._reads) > _MAX_STREAMS * 4:
            self._reads.popitem(last=False)
        return False

    def sequential(self, index: int, off: int, end: int) -> bool:
        """Record a read of off..end of file `index`; True when it starts at 0 or continues
        the previous read of the file (within _NEAR: the kernel may reorder a little) for the
        second time in a row. Sequential readers take whole blobs with chunk read-ahead (large
        preads, fewer requests); random readers take frames."""
        last, streak = self._streams.pop(index, (-1, 0))
        streak = 2 if off == 0 else (streak + 1 if abs(last - off) <= _NEAR else 0)
        self._streams[index] = (max(end, last) if streak else end, streak)
        if len(self._streams) > _MAX_STREAMS:
            self._streams.popitem(last=False)
        return streak >= 2
