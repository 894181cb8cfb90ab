"""The message codec and handler table: malformed input gets an error reply, never a crash."""

from __future__ import annotations

import contextlib
import errno

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from fanstore_fuse._messages import (
    HEADER,
    MAX_BODY,
    OP_FETCH_BLOB,
    OP_PING,
    Frame,
    HandlerTable,
    ProtocolError,
    decode,
)


def test_round_trip():
    f = Frame(OP_FETCH_BLOB, 7, 42, b"abc", 0)
    g = decode(f.encode())
    assert (g.op, g.req_id, g.arg, bytes(g.body), g.err) == (OP_FETCH_BLOB, 7, 42, b"abc", 0)


def test_oversized_body_refused():
    with pytest.raises(ProtocolError):
        Frame(OP_PING, 1, body=b"\0" * (MAX_BODY + 1)).encode()


@given(st.binary(max_size=200))
@settings(max_examples=300, deadline=None)
def test_decoder_never_crashes(data):
    with contextlib.suppress(ProtocolError):
        decode(data)


def _table() -> HandlerTable:
    t = HandlerTable()

    async def ping(src, req):
        return Frame(req.op, req.req_id, 99)

    async def boom(src, req):
        raise RuntimeError("handler bug")

    t.register(OP_PING, ping)
    t.register(OP_FETCH_BLOB, boom)
    return t


@given(st.binary(max_size=300))
@settings(max_examples=200, deadline=None)
def test_dispatch_of_random_bytes_is_an_error_reply(data):
    reply = trio.run(_table().dispatch, 0, data)
    f = decode(reply)
    if f.err == 0:  # only a well-formed ping can succeed
        assert f.arg == 99


async def test_dispatch_maps_handler_bugs_to_eio():
    t = _table()
    f = decode(await t.dispatch(3, Frame(OP_FETCH_BLOB, 5, 1).encode()))
    assert f.err == errno.EIO and f.req_id == 5
    f = decode(await t.dispatch(3, Frame(77, 6).encode()))
    assert f.err == errno.EPROTO and f.req_id == 6
    f = decode(await t.dispatch(3, Frame(OP_PING, 8).encode()))
    assert f.err == 0 and f.arg == 99 and f.req_id == 8
    assert len(HEADER.pack(0, 0, 0, 0, 0, 0, 0)) == HEADER.size
