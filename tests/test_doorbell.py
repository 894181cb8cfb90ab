"""Doorbells without MPI: a ring wakes the peer's wait, a local wake ends it from another
thread, a wait without either times out, and rings nobody hears never raise."""

from __future__ import annotations

import socket
import threading
import time

from fanstore_fuse._doorbell import Doorbell


def _pair() -> tuple[Doorbell, Doorbell]:
    a, b = Doorbell(), Doorbell()
    peers: list[tuple[str, int] | None] = [("127.0.0.1", a.sock.getsockname()[1]),
                                           ("127.0.0.1", b.sock.getsockname()[1])]
    a.peers = b.peers = peers  # what the Iallgather gives both ranks
    return a, b


def test_ring_wakes_the_peer_and_waits_time_out():
    a, b = _pair()
    try:
        t0 = time.perf_counter()
        assert b.wait(0.02) is False
        assert time.perf_counter() - t0 >= 0.015
        a.ring(1)
        a.ring(1)  # two rings, one wake-up: the wait drains them all
        assert b.wait(5.0) is True
        assert b.wait(0.01) is False
        assert a.wait(0.01) is False  # the ringer's own bell stays quiet
    finally:
        a.close()
        b.close()


def test_local_wake_from_another_thread():
    a, b = _pair()
    try:
        threading.Timer(0.05, a.wake).start()
        t0 = time.perf_counter()
        assert a.wait(5.0) is True
        assert time.perf_counter() - t0 < 4.0
        assert a.wait(0.01) is False
    finally:
        a.close()
        b.close()


def test_rings_nobody_hears_are_harmless():
    a, b = _pair()
    dead = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()  # nothing listens there: the kernel answers with ICMP port unreachable
    try:
        a.peers = [a.peers[0], ("127.0.0.1", port), None]  # type: ignore[index]
        a.ring(1)
        a.ring(2)  # no address
        a.ring(7)  # no such rank
        a.ring(1)
        a.wait(0.05)  # the ICMP errors may wake it once: drained, not raised
        assert a.wait(0.01) is False
    finally:
        a.close()
        b.close()
