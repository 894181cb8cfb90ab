"""Every inter-node message: tags, operations, the frame codec, size limits, the handler table.

A frame is a fixed little-endian header followed by a body:

    magic u16 | version u8 | op u8 | errno i32 | request id u64 | arg u64 | body length u32

Requests travel with TAG_REQUEST, responses with TAG_RESPONSE and the request's id. Blob bodies
are the blob's stored bytes (still compressed, verified by the reader); metadata bodies are
msgpack. A frame that does not decode gets an EPROTO error response, never a crash.
"""

from __future__ import annotations

import errno
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from ._errors import FanstoreError

TAG_REQUEST = 100
TAG_RESPONSE = 101

MAGIC = 0xF5F5
VERSION = 1
HEADER = struct.Struct("<HBBiQQI")
MAX_BODY = 80 << 20  # a 64 MiB chunk plus slack; anything larger is refused
MAX_FRAME = HEADER.size + MAX_BODY

# Operations
OP_PING = 1
OP_FETCH_BLOB = 2  # arg = blob id -> body = stored bytes
OP_LOOKUP = 3  # body = msgpack path -> body = msgpack record
OP_LISTDIR = 4  # arg = start << 32 | limit, body = msgpack path -> msgpack [records]
OP_STATUS = 5  # -> msgpack dict
OP_RECORDS = 6  # body = msgpack [entry index...] -> msgpack [records] (bulk warm-up)
OP_W_PUBLISH = 7  # body = msgpack [entry, exclusive] -> ack (EEXIST on a conflict)
OP_W_UNPUBLISH = 8  # body = msgpack path -> ack
OP_W_STAT = 9  # body = msgpack path -> msgpack entry
OP_W_LIST = 10  # body = msgpack dir path -> msgpack [entries]
OP_W_READ = 11  # arg = chunk, body = msgpack [path, n] -> n bytes at chunk*CHUNK (reader verifies)
OP_STAGE_OUT = 12  # body = msgpack out dir -> msgpack stage-out summary of the rank's written files
OP_W_SYNC = 13  # body = msgpack path -> msgpack entry (the writer commits and publishes it first)
OP_STOP = 14  # -> ack; the rank then unmounts and ends (`umount` run on another node ends every node)
OP_W_DIRTY = 15  # body = msgpack path of a dataset directory -> ack (it now holds written entries)
OP_NAMES = {
    OP_PING: "ping",
    OP_FETCH_BLOB: "fetch_blob",
    OP_LOOKUP: "lookup",
    OP_LISTDIR: "listdir",
    OP_STATUS: "status",
    OP_RECORDS: "records",
    OP_W_PUBLISH: "publish",
    OP_W_UNPUBLISH: "unpublish",
    OP_W_STAT: "written_stat",
    OP_W_LIST: "written_list",
    OP_W_READ: "written_read",
    OP_STAGE_OUT: "stage_out",
    OP_W_SYNC: "written_sync",
    OP_STOP: "stop",
    OP_W_DIRTY: "written_dir",
}


class ProtocolError(FanstoreError):
    errno = errno.EPROTO


@dataclass(slots=True)
class Frame:
    op: int
    req_id: int
    arg: int = 0
    body: bytes | memoryview = b""
    err: int = 0

    def encode(self) -> bytes:
        if len(self.body) > MAX_BODY:
            raise ProtocolError(f"message body of {len(self.body)} bytes exceeds {MAX_BODY}")
        return HEADER.pack(MAGIC, VERSION, self.op, self.err, self.req_id, self.arg, len(self.body)) + (
            bytes(self.body)
        )


UNZEROED_FROM = 64 << 10  # buffers this big are allocated without zeroing them first


def alloc(n: int) -> bytearray | memoryview:
    """A writable buffer of n bytes for a frame about to be filled whole (received, or read
    from disk): large ones are not zeroed first (a 4 MiB memset costs as much as the read)."""
    return np.empty(n, np.uint8).data if n >= UNZEROED_FROM else bytearray(n)


def frame_buffer(op: int, req_id: int, arg: int, body_len: int) -> tuple[bytearray | memoryview, memoryview]:
    """A whole frame allocated at once, header filled in; the caller fills the body view.
    Lets a 4 MiB blob be read from disk straight into the message (no concatenation copy)."""
    if body_len > MAX_BODY:
        raise ProtocolError(f"message body of {body_len} bytes exceeds {MAX_BODY}")
    buf = alloc(HEADER.size + body_len)
    HEADER.pack_into(buf, 0, MAGIC, VERSION, op, 0, req_id, arg, body_len)
    return buf, memoryview(buf)[HEADER.size :]


def decode(buf: bytes | bytearray | memoryview) -> Frame:
    """Parse a frame; raise ProtocolError on anything malformed."""
    if len(buf) < HEADER.size:
        raise ProtocolError(f"frame of {len(buf)} bytes is shorter than the header")
    if len(buf) > MAX_FRAME:
        raise ProtocolError(f"frame of {len(buf)} bytes exceeds the limit")
    magic, version, op, err, req_id, arg, blen = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise ProtocolError("bad magic")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} unsupported")
    if blen != len(buf) - HEADER.size:
        raise ProtocolError(f"body length {blen} does not match frame ({len(buf) - HEADER.size})")
    return Frame(op, req_id, arg, memoryview(buf)[HEADER.size :], err)


def request_id_of(buf: bytes | bytearray | memoryview) -> int:
    """Best effort: the request id of a possibly malformed frame (0 if unreadable)."""
    if len(buf) >= HEADER.size:
        return int(HEADER.unpack_from(buf)[4])
    return 0


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(body: bytes | bytearray | memoryview) -> Any:
    try:
        return msgpack.unpackb(body, raw=False, max_bin_len=MAX_BODY, max_str_len=1 << 16)
    except Exception as e:
        raise ProtocolError(f"bad msgpack body: {e}") from None


Wire = bytes | bytearray | memoryview  # a whole encoded frame
Handler = Callable[[int, Frame], Awaitable["Frame | bytearray | memoryview"]]
# Served on the transport's own thread (no trio hop): called with the most bytes it may wait on
# the disk for (`block_upto`; 0: none), returning None if it would have to wait for more; then
# again in a worker thread with a larger limit. Must be thread-safe.
InlineHandler = Callable[[int, Frame, int], "Frame | bytearray | memoryview | None"]


class HandlerTable:
    """op -> async handler(source rank, request) -> response frame. One table per daemon.

    An op may also have an inline handler (`register_inline`), which the MPI transport runs on
    its own thread, so a small blob is answered without a hop to trio and back."""

    def __init__(self) -> None:
        self._handlers: dict[int, Handler] = {}
        self._inline: dict[int, InlineHandler] = {}

    def register(self, op: int, handler: Handler) -> None:
        if op not in OP_NAMES:
            raise ValueError(f"unknown op {op}")
        self._handlers[op] = handler

    def register_inline(self, op: int, handler: InlineHandler) -> None:
        if op not in OP_NAMES:
            raise ValueError(f"unknown op {op}")
        self._inline[op] = handler

    def is_inline(self, raw: bytes | bytearray | memoryview) -> bool:
        """Whether this request goes to an inline handler (by its op byte; a malformed frame
        with that op byte gets its error reply from `dispatch_inline`)."""
        return len(raw) >= HEADER.size and raw[3] in self._inline

    def dispatch_inline(self, source: int, raw: Wire, block_upto: int) -> Wire | None:
        """The reply of the op's inline handler, or None when it would have to wait on the
        disk for more than `block_upto` bytes (call again with a larger `block_upto` off the
        transport's thread); every failure becomes an error reply."""
        try:
            req = decode(raw)
            resp = self._inline[req.op](source, req, block_upto)
            return None if resp is None else _encode_reply(req, resp)
        except Exception as e:
            return _error_reply(raw, e)

    async def dispatch(self, source: int, raw: bytes) -> Wire:
        """Decode, run the handler, encode the reply; every failure becomes an error reply."""
        try:
            req = decode(raw)
            handler = self._handlers.get(req.op)
            if handler is None:
                raise ProtocolError(f"unknown op {req.op}")
            return _encode_reply(req, await handler(source, req))
        except Exception as e:
            return _error_reply(raw, e)


def _encode_reply(req: Frame, resp: Frame | bytearray | memoryview) -> Wire:
    if not isinstance(resp, Frame):  # pre-built by frame_buffer for this request
        return bytes(resp) if len(resp) < 4096 else resp
    resp.req_id = req.req_id
    resp.op = req.op
    return resp.encode()


def _error_reply(raw: bytes | bytearray | memoryview, e: Exception) -> bytes:
    """A domain error keeps its errno and message; a bug in a handler must not kill the
    daemon: it becomes EIO."""
    if isinstance(e, FanstoreError):
        return Frame(0, request_id_of(raw), err=e.errno, body=str(e).encode()[:1024]).encode()
    return Frame(0, request_id_of(raw), err=errno.EIO, body=repr(e).encode()[:1024]).encode()
