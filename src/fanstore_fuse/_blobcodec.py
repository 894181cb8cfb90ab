"""Blob codecs: decode and verify stored blobs (`BlobCodec`), and seekable blobs (codec 3,
`CODEC_FRAMED`; see docs/format.md "Framed blobs").

A framed blob is a frame table followed by independent frames of `frame_size` raw bytes (the
last may be shorter), each stored raw or as one zstd frame, each with the xxh3 of its raw
bytes in the table. The manifest's `xxh3` of a framed blob covers the table, so a reader that
checked the table against the manifest can read and verify one frame alone: a small read of a
large file decodes one frame, and corrupt bytes never reach a reader.

Layout (little-endian): u32 frame_size, u32 n_frames, then per frame u32 word (bits 0..30: the
stored length, bit 31: zstd) and u64 xxh3 of the frame's raw bytes; then the frames back to back.
"""

from __future__ import annotations

import struct
import threading
from array import array
from collections.abc import Callable
from dataclasses import dataclass

import zstandard

from ._errors import ChecksumError
from ._format import (
    CODEC_FRAMED,
    CODEC_RAW,
    CODEC_ZSTD_DICT,
    FRAME_ENTRY,
    FRAME_HEAD,
    MAX_CHUNK_SIZE,
    MIN_FRAME,
    checksum,
)

_HEAD = struct.Struct("<II")  # frame_size, n_frames
_ENTRY = struct.Struct("<IQ")  # stored length | ZSTD_BIT, xxh3 of the raw bytes
assert _HEAD.size == FRAME_HEAD and _ENTRY.size == FRAME_ENTRY
ZSTD_BIT = 1 << 31
MAX_FRAME = MAX_CHUNK_SIZE

# Verified raw bytes as they are handed on: a buffer read or received for one blob alone is
# passed on without a copy (a memoryview of a received frame's body, of a stored blob after
# its frame table), and pyfuse3 replies from any buffer.
Buffer = bytes | bytearray | memoryview
DEFAULT_FRAME_SIZE = 128 << 10  # zstd frames: one buffered FUSE read (128 KiB) decodes one
RAW_FRAME_SIZE = 16 << 10  # raw sub-blocks: a 4 KiB random read reads and hashes 16 KiB


def table_size(n_frames: int) -> int:
    return _HEAD.size + _ENTRY.size * n_frames


def n_frames(raw_len: int, frame_size: int) -> int:
    return -(-raw_len // frame_size)


@dataclass(frozen=True)
class FrameTable:
    """A verified frame table: where frame k's stored bytes lie (relative to the blob's start)
    and how to decode and check them."""

    frame_size: int
    raw_len: int
    offsets: array  # n + 1 stored offsets (u64); frame k is offsets[k]:offsets[k+1]
    zstd: bytes  # 1 where frame k is a zstd frame
    digests: array  # u64 xxh3 of each frame's raw bytes

    @property
    def count(self) -> int:
        return len(self.digests)

    def raw_size(self, k: int) -> int:
        return min(self.frame_size, self.raw_len - k * self.frame_size)

    def span(self, k0: int, k1: int) -> tuple[int, int]:
        """Stored (offset, length) of frames k0..k1 inclusive, relative to the blob."""
        return self.offsets[k0], self.offsets[k1 + 1] - self.offsets[k0]


def table_bytes_needed(
    head: bytes | memoryview, stored_len: int, where: str, raw_len: int | None = None
) -> int:
    """From the first 8 stored bytes: how many bytes the table takes, bounded by the blob and,
    given the manifest's `raw_len`, by the frame count that raw size allows (checked before
    anything of that size is read: the fields are checked against the checksum after)."""
    if len(head) < _HEAD.size or stored_len < _HEAD.size:
        raise ChecksumError(f"{where}: framed blob too short for its frame table")
    size, n = _HEAD.unpack_from(head)
    need = table_size(n)
    if need > stored_len:
        raise ChecksumError(f"{where}: frame table of {n} frames overruns the blob")
    if raw_len is not None:
        _check_shape(size, n, raw_len, where)
    return need


def _check_shape(size: int, n: int, raw_len: int, where: str) -> None:
    if not MIN_FRAME <= size <= MAX_FRAME or n != n_frames(raw_len, size) or not n:
        raise ChecksumError(f"{where}: frame table does not fit the blob ({n} x {size})")


def parse_table(
    buf: bytes | memoryview, stored_len: int, raw_len: int, digest: int, where: str
) -> FrameTable:
    """Check the table at the start of `buf` against the manifest's digest, then its fields."""
    need = table_bytes_needed(buf, stored_len, where, raw_len)
    if len(buf) < need:
        raise ChecksumError(f"{where}: frame table truncated")
    if checksum(memoryview(buf)[:need]) != digest:
        raise ChecksumError(f"{where}: frame table checksum mismatch")
    size, n = _HEAD.unpack_from(buf)
    offsets = array("Q", [need])
    zstd, digests = bytearray(), array("Q")
    for k, (word, d) in enumerate(_ENTRY.iter_unpack(memoryview(buf)[_HEAD.size : need])):
        length, packed = word & ~ZSTD_BIT, bool(word & ZSTD_BIT)
        rlen = min(size, raw_len - k * size)
        if (not packed and length != rlen) or (packed and length == 0):
            raise ChecksumError(f"{where}: frame {k} has a bad stored length {length}")
        offsets.append(offsets[-1] + length)
        zstd.append(packed)
        digests.append(d)
    if offsets[-1] != stored_len:
        raise ChecksumError(f"{where}: frames end at {offsets[-1]}, the blob has {stored_len}")
    return FrameTable(size, raw_len, offsets, bytes(zstd), digests)


_LOCAL = threading.local()


def _dctx() -> zstandard.ZstdDecompressor:
    """This thread's decompressor (reused: making one per frame costs ~100 us)."""
    d = getattr(_LOCAL, "d", None)
    if d is None:
        d = _LOCAL.d = zstandard.ZstdDecompressor()
    return d


def decode_frame(t: FrameTable, k: int, stored: bytes | memoryview, where: str) -> bytes:
    """Decode and verify frame k from its stored bytes; never returns unverified bytes."""
    rlen = t.raw_size(k)
    if t.zstd[k]:
        try:
            claimed = zstandard.frame_content_size(stored)
            if claimed != rlen:  # no bomb: the output is never larger than the frame
                raise ChecksumError(f"{where}: frame {k} claims {claimed} bytes, expected {rlen}")
            raw = _dctx().decompress(stored, max_output_size=rlen)
        except zstandard.ZstdError as e:
            raise ChecksumError(f"{where}: frame {k} corrupt ({e})") from None
    else:
        raw = stored if isinstance(stored, bytes) else bytes(stored)
    if len(raw) != rlen:
        raise ChecksumError(f"{where}: frame {k} decoded {len(raw)} bytes, expected {rlen}")
    if checksum(raw) != t.digests[k]:
        raise ChecksumError(f"{where}: frame {k} xxh3 checksum mismatch")
    return raw


def decode_all(stored: Buffer, raw_len: int, digest: int, where: str) -> Buffer:
    """The whole blob (a remote fetch, a sequential reader, verify): every frame decoded and
    verified. Raw frames are checked in place; when every frame is raw the result is a view of
    `stored` after its table (no copy: a fresh 4 MiB buffer costs a page fault per 4 KiB),
    else the frames are joined with one copy."""
    mv = memoryview(stored)
    t = parse_table(mv, len(mv), raw_len, digest, where)
    o = t.offsets
    pieces: list[bytes | memoryview] = []
    for k in range(t.count):
        piece = mv[o[k] : o[k + 1]]
        if t.zstd[k]:
            pieces.append(decode_frame(t, k, piece, where))
        elif checksum(piece) != t.digests[k]:
            raise ChecksumError(f"{where}: frame {k} xxh3 checksum mismatch")
        else:
            pieces.append(piece)
    if not any(t.zstd):  # raw frames lie back to back after the table
        return mv[o[0] :]
    return b"".join(pieces)


def encode(
    raw: bytes, frame_size: int, compress: Callable[[bytes], bytes] | None,
) -> tuple[bytes, int]:
    """(stored bytes, manifest digest) of `raw` as a framed blob; each frame is compressed with
    `compress` and kept compressed only if smaller."""
    entries, frames = [], []
    mv = memoryview(raw)
    for a in range(0, len(raw), frame_size):
        piece = bytes(mv[a : a + frame_size])
        word, data = len(piece), piece
        if compress is not None:
            packed = compress(piece)
            if len(packed) < len(piece):
                word, data = len(packed) | ZSTD_BIT, packed
        entries.append(_ENTRY.pack(word, checksum(piece)))
        frames.append(data)
    table = _HEAD.pack(frame_size, len(frames)) + b"".join(entries)
    return table + b"".join(frames), checksum(table)


class BlobCodec:
    """Decode and verify stored blob bytes (thread-safe: one decompressor per thread, the
    dictionary's one loaded once per thread, not per blob)."""

    def __init__(self, zdict: bytes = b""):
        self._zdict = zstandard.ZstdCompressionDict(zdict) if zdict else None
        self._local = threading.local()

    def _ddctx(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._local, "d", None)
        if d is None:
            d = self._local.d = zstandard.ZstdDecompressor(dict_data=self._zdict)
        return d

    def decode(
        self, stored: Buffer, codec: int, raw_len: int, digest: int, where: str,
    ) -> Buffer:
        """The raw bytes of a stored blob, verified. `stored` must be a buffer of this blob
        alone that nothing writes to again: a raw blob is returned as it is."""
        if codec == CODEC_FRAMED:
            return decode_all(stored, raw_len, digest, where)
        if codec == CODEC_RAW:
            raw = stored
        else:
            # A frame that claims more than the recorded raw length (a zstd bomb) is refused
            # before any output is allocated; without a content size the output is capped.
            try:
                claimed = zstandard.frame_content_size(stored)
            except zstandard.ZstdError as e:
                raise ChecksumError(f"{where}: corrupt compressed blob ({e})") from None
            if claimed > raw_len:
                raise ChecksumError(f"{where}: frame claims {claimed} bytes, expected {raw_len}")
            try:
                d = self._ddctx() if codec == CODEC_ZSTD_DICT else _dctx()
                raw = d.decompress(stored, max_output_size=raw_len)
            except zstandard.ZstdError as e:
                raise ChecksumError(f"{where}: corrupt compressed blob ({e})") from None
        if len(raw) != raw_len:
            raise ChecksumError(f"{where}: decoded {len(raw)} bytes, expected {raw_len}")
        if checksum(raw) != digest:
            raise ChecksumError(f"{where}: xxh3 checksum mismatch")
        return raw
