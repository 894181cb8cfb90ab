"""Doorbells: a UDP datagram that wakes a peer's MPI thread when a frame was sent to it.

MPI offers nothing to block on (MPICH's blocking calls spin), so a sleeping MPI thread finds a
new message only at its next poll, and polling often costs CPU (~40 us per wake-up on two busy
cores). With doorbells, each rank's MPI thread waits in `select` on a UDP socket (and a pipe the
local trio thread writes to), and a sender rings the receiver's bell after each `Isend`: the
receiver wakes when a frame arrives instead of every few tens of microseconds.

Bells are only a hint. The addresses are exchanged with a non-blocking `Iallgather` (nothing
waits for it); a lost or early datagram costs at most one poll interval, because the MPI thread
still wakes at least every `FANSTORE_MPI_MAX_SLEEP` while replies are due and every 5 ms when
idle; and a transport whose frames keep arriving unannounced stops relying on bells
(`MpiTransport`). Ranks on one host ring 127.0.0.1; others the address their host name
resolves to.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import struct
from typing import Any

log = logging.getLogger("fanstore_fuse.doorbell")

_RECORD = struct.Struct("<64s4sH")  # host name, IPv4 address, UDP port


class Doorbell:
    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.setblocking(False)
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self.sleeping = False  # set by the MPI thread around its waits
        self.peers: list[tuple[str, int] | None] | None = None  # None until the gather is done
        self._gather: Any = None
        self._table = bytearray()

    def start(self, comm: Any, byte: Any) -> None:
        """Post the exchange of every rank's address (collective, non-blocking)."""
        host = socket.gethostname()
        try:
            ip = socket.inet_aton(socket.gethostbyname(host))
        except OSError:
            ip = socket.inet_aton("127.0.0.1")
        port = self.sock.getsockname()[1]
        self._mine = bytearray(_RECORD.pack(host.encode()[:64], ip, port))
        self._table = bytearray(_RECORD.size * comm.Get_size())
        self._gather = comm.Iallgather([self._mine, byte], [self._table, byte])

    def ready(self) -> bool:
        """Whether the addresses are known (tests the gather; call from the MPI thread)."""
        if self.peers is not None:
            return True
        if self._gather is None or not self._gather.Test():
            return False
        me = self._mine[:64]
        peers: list[tuple[str, int] | None] = []
        for off in range(0, len(self._table), _RECORD.size):
            host, ip, port = _RECORD.unpack_from(self._table, off)
            addr = "127.0.0.1" if host == bytes(me) else socket.inet_ntoa(ip)
            peers.append((addr, port) if port else None)
        self.peers = peers
        return True

    def ring(self, dest: int) -> None:
        """Wake rank `dest`'s MPI thread (best effort)."""
        peers = self.peers
        if peers is not None and 0 <= dest < len(peers):
            addr = peers[dest]
            if addr is not None:
                with contextlib.suppress(OSError):  # a full buffer, an unreachable peer: it polls
                    self.sock.sendto(b"\0", addr)

    def wake(self) -> None:
        """Wake this rank's MPI thread (from any thread)."""
        with contextlib.suppress(BlockingIOError):  # one already pending
            os.write(self._w, b"\0")

    def wait(self, timeout: float) -> bool:
        """Sleep until a bell or a local wake, or `timeout` seconds; True if woken."""
        r, _, _ = select.select([self.sock.fileno(), self._r], [], [], timeout)
        if not r:
            return False
        while True:
            try:
                self.sock.recv(64)
            except OSError:  # drained (BlockingIOError), or an ICMP error of an earlier ring
                break
        with contextlib.suppress(BlockingIOError):
            os.read(self._r, 4096)
        return True

    def close(self) -> None:
        self.sock.close()
        for fd in (self._r, self._w):
            with contextlib.suppress(OSError):
                os.close(fd)
