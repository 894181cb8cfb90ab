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
    frame_buffer,
    pack,
    request_id_of,
    unpack,
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


def _expected_reply(data: bytes) -> tuple[int, int]:
    """(errno, arg) the table must answer to `data`: a ping succeeds, everything else fails."""
    try:
        req = decode(data)
    except ProtocolError:
        return errno.EPROTO, 0
    if req.op == OP_PING:
        return 0, 99
    if req.op == OP_FETCH_BLOB:
        return errno.EIO, 0
    return errno.EPROTO, 0


_frames = st.builds(
    lambda op, rid, arg, body: Frame(op, rid, arg, body).encode(),
    st.sampled_from([OP_PING, OP_FETCH_BLOB, 0, 77, 255]),
    st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.binary(max_size=64),
)


@given(st.one_of(st.binary(max_size=300), _frames,
                 _frames.flatmap(lambda f: st.integers(0, len(f) - 1).map(lambda n: f[:n]))))
@settings(max_examples=300, deadline=None)
def test_dispatch_answers_every_input_with_the_right_reply(data):
    f = decode(trio.run(_table().dispatch, 0, data))
    assert (f.err, f.arg) == _expected_reply(data)
    assert f.req_id == request_id_of(data)
    if f.err:
        assert bytes(f.body)  # an error reply says what went wrong


def test_frame_buffer_is_a_frame_with_its_body_in_place():
    buf, body = frame_buffer(OP_FETCH_BLOB, 9, 1234, 5)
    body[:] = b"hello"
    f = decode(buf)
    assert (f.op, f.req_id, f.arg, bytes(f.body), f.err) == (OP_FETCH_BLOB, 9, 1234, b"hello", 0)
    with pytest.raises(ProtocolError):
        frame_buffer(OP_FETCH_BLOB, 1, 0, MAX_BODY + 1)


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[:HEADER.size - 1], "shorter than the header"),
    (lambda b: b"\0\0" + b[2:], "bad magic"),
    (lambda b: b[:2] + b"\x02" + b[3:], "version 2"),
    (lambda b: b + b"x", "does not match"),
    (lambda b: b[:-1], "does not match"),
])
def test_malformed_frames_are_named(damage, message):
    good = Frame(OP_PING, 3, 4, b"body").encode()
    with pytest.raises(ProtocolError, match=message):
        decode(damage(good))


def test_request_id_of_short_and_long_frames():
    assert request_id_of(b"abc") == 0
    assert request_id_of(Frame(OP_PING, 77).encode()) == 77
    assert unpack(pack([b"x", 1])) == [b"x", 1]
    with pytest.raises(ProtocolError):
        unpack(b"\xc1")


async def test_dispatch_maps_handler_bugs_to_eio():
    t = _table()
    f = decode(await t.dispatch(3, Frame(OP_FETCH_BLOB, 5, 1).encode()))
    assert f.err == errno.EIO and f.req_id == 5
    f = decode(await t.dispatch(3, Frame(77, 6).encode()))
    assert f.err == errno.EPROTO and f.req_id == 6
    f = decode(await t.dispatch(3, Frame(OP_PING, 8).encode()))
    assert f.err == 0 and f.arg == 99 and f.req_id == 8
    assert len(HEADER.pack(0, 0, 0, 0, 0, 0, 0)) == HEADER.size


def test_read_reply_turns_error_frames_into_errors():
    from fanstore_fuse._errors import PeerError
    from fanstore_fuse._transport import RemoteError, read_reply

    ok = read_reply(2, OP_PING, Frame(OP_PING, 5, 7).encode())
    assert (ok.req_id, ok.arg) == (5, 7)
    with pytest.raises(RemoteError, match="rank 2 fetch_blob: no such blob") as ei:
        read_reply(2, OP_FETCH_BLOB, Frame(0, 5, err=errno.ENOENT, body=b"no such blob").encode())
    assert ei.value.errno == errno.ENOENT
    with pytest.raises(PeerError, match="malformed ping reply"):
        read_reply(2, OP_PING, b"\x00" * 5)
