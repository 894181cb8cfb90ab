"""MPI point-to-point transport: one thread owns every MPI call, bridged to trio.

The MPI thread posts `Isend`s from an outgoing queue (an eager send is complete at once and
not tracked), matches incoming messages with `improbe` + `Message.Recv`, completes rendezvous
sends with `Testsome`, and polls: MPI offers nothing to block on (MPICH's blocking calls spin a
core), so the thread sleeps between polls. A reply it waits for and, for a quarter second after
a peer's last request (`IDLE_AFTER`), the peers' next request are slept for until they are due
(`ReplyClock`, `RequestClock`), then polled for from 20 us up to 100 us (`POLL_FIRST`,
`POLL_MAX`), as is a rendezvous send. Otherwise the thread idles 5 ms between polls
(`IDLE_SLEEP`), 20 ms after a minute (`DEEP_IDLE_SLEEP`). A frame posted by trio (a request or
a reply of this rank) ends any sleep at once; a frame from another rank waits for the next poll.

Blob requests are answered on the MPI thread itself when the page cache holds the blob, or by
one of its disk threads (`HandlerTable.register_inline`): no hop to trio and back. Every other
frame received in one wake-up goes to trio in one `TrioToken.run_sync_soon` call; trio tasks
serve those requests concurrently and wait for responses with a timeout. A request that is the
only one in flight while trio has nothing else to run waits with the trio thread blocked instead
(`_wait_blocking`), until its reply is in, the kernel queues a FUSE request or a peer's request
for trio comes.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import math
import mmap
import os
import select
import threading
import time
from collections import deque
from collections.abc import Container
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import trio

from ._errors import FanstoreError, PeerError
from ._fsio import name_this_thread
from ._messages import (
    HEADER,
    MAX_FRAME,
    OP_NAMES,
    TAG_REQUEST,
    TAG_RESPONSE,
    Frame,
    HandlerTable,
    ProtocolError,
    Wire,
    alloc,
    decode,
    request_id_of,
)

log = logging.getLogger("fanstore_fuse.transport")

# Poll intervals of the MPI thread. A peer's request waits for this rank's next poll, and a
# reader of remote files pays that wait twice per file (its request, the reply), so while
# requests are recent the interval stays short (POLL_MAX); each poll is a wake-up that costs
# CPU (`python -m bench.cost` shows the remote latency and CPU per file).
POLL_FIRST = 20e-6
POLL_MAX = 100e-6
POLL_GROWTH = 2.0
IDLE_AFTER = 0.25  # seconds without traffic before IDLE_SLEEP
IDLE_SLEEP = 0.005  # idle: ~200 wake-ups/s, a request from a peer waits 2.5 ms on average
DEEP_IDLE_S = 60.0  # a minute without traffic (a training step that reads nothing)...
DEEP_IDLE_SLEEP = 0.02  # ...then 50 wake-ups/s; the first request after it waits <= 20 ms
MAX_SERVING = 64  # concurrent requests served per daemon
SYNC_WAIT_MS = 3  # the longest a lone request blocks the event loop (`_wait_blocking`)
# After a blocked wait that gave the event loop back (a FUSE request came, or the reply was
# slow), this many requests wait through trio: with several readers most blocked waits would
# end that way, each a wasted poll(2).
BLOCKING_OFF = 16
STOP_JOIN = 5.0  # seconds the MPI thread gets to stop when the daemon ends
IO_THREADS = 4  # threads reading the disk for inline requests the page cache cannot answer
# A blob up to this size that the page cache lacks is read by the MPI thread itself while no
# disk thread is busy: one reader's request then costs no hand-off to a disk thread and back
# (each a wake-up of both threads); with several in flight they go to the disk threads.
INLINE_DISK_BYTES = 256 << 10


# MPICH's shared-memory path between ranks of one host sends a message of 8 KiB or more by CMA
# (the receiver copies it with process_vm_readv, then acknowledges): the sender's request ends
# only when its progress sees that acknowledgement, so a rank serving a small blob has to wake
# again to test each reply's send before it is done with it.
# Below EAGER_BYTES a reply is copied into a shared-memory cell instead and its send is
# complete at once; larger ones (chunks of large files) keep the single copy of CMA.
EAGER_BYTES = 256 << 10
EAGER_CELL = EAGER_BYTES + (4 << 10)  # a reply of EAGER_BYTES and MPICH's headers fit a cell
EAGER_CELLS = 32  # per rank, in shared memory: 8.3 MiB (MPICH's default 64 cells of 8 KiB)


def mpich_shm_defaults(environ: Any = os.environ) -> None:
    """Set MPICH's eager shared-memory limits before `MPI_Init` (every rank runs this, so they
    agree, as MPICH requires). Settings already in the environment win. Not inside a Slurm job:
    there the test cluster's `srun --mpi=pmi2` ranks exited during start-up with them, and one
    daemon per node has no same-host peer to gain from. The pack buffers must hold a cell or
    MPICH aborts at init."""
    if "SLURM_JOB_ID" in environ:
        return
    for key, value in (("MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_CELL_SIZE", EAGER_CELL),
                       ("MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_NUM_CELLS", EAGER_CELLS),
                       ("MPIR_CVAR_CH4_IPC_CMA_P2P_THRESHOLD", EAGER_BYTES)):
        environ.setdefault(key, str(value))
    cell = int(environ["MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_CELL_SIZE"])
    if int(environ.get("MPIR_CVAR_CH4_PACK_BUFFER_SIZE", "16384")) < cell:
        environ["MPIR_CVAR_CH4_PACK_BUFFER_SIZE"] = str(cell)


# Between nodes MPICH's OFI netmod runs over libfabric's TCP provider, which keeps a message that
# arrives before a receive is posted for it ("unexpected") in a buffer of its own and copies it
# out when it is matched. Every reply a daemon takes is unexpected (it matches with `Improbe` +
# `Mrecv`), so without this each 4 MiB chunk read from a peer is copied once more on the reading
# node (a memcpy under `PMPI_Mrecv`; `perf record -g` on a remote pass shows it). Above
# FI_TCP_MAX_SAVED_SIZE the provider sends a ready-to-send instead, and the data follows into
# the matched buffer once it is claimed (its rendezvous protocol). Replies of whole
# small blobs (up to EAGER_BYTES) stay eager: a copy of them costs less than a round trip.
TCP_SAVED_BYTES = EAGER_BYTES + (4 << 10)


def ofi_tcp_defaults(environ: Any = os.environ) -> None:
    """Set libfabric's TCP provider to take messages above TCP_SAVED_BYTES by rendezvous, before
    `MPI_Init` (every rank runs this: the sender decides by its own limit). A value already in
    the environment wins (libfabric's own default: every unexpected message buffered)."""
    environ.setdefault("FI_TCP_MAX_SAVED_SIZE", str(TCP_SAVED_BYTES))


def mpi_env_defaults(environ: Any = os.environ) -> None:
    """Every setting a daemon gives MPICH before `MPI_Init`."""
    mpich_shm_defaults(environ)
    ofi_tcp_defaults(environ)


SHM_SEGMENTS = "/dev/shm/mpich_shm_"


def unlink_shared_segments(fd_dir: str = "/proc/self/fd") -> list[str]:
    """Remove the names of the MPICH shared-memory segments this process holds open (/dev/shm/
    mpich_shm_*; MPICH keeps a segment's descriptor open for as long as it maps it), once every
    rank of this host has attached them (a barrier after MPI_Init, see `_daemon.communicator`):
    the mappings stay, only the names go. MPICH removes them in MPI_Finalize alone, so a daemon
    ended any other way (SIGKILL, the OOM killer, one rank's mount unmounted on its own, which
    ends the mpiexec job) would leave 17-51 MB of RAM per job behind in /dev/shm for good
    (docs/reliability.md). Returns the names removed (another rank of the host may have removed
    them first)."""
    names: set[str] = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(fd_dir):
            with contextlib.suppress(OSError):
                path = os.readlink(os.path.join(fd_dir, fd))
                if path.startswith(SHM_SEGMENTS) and not path.endswith("(deleted)"):
                    names.add(path)
    gone = []
    for path in sorted(names):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            gone.append(path)
    return gone


class RemoteError(FanstoreError):
    """An error answer from a peer, carrying the peer's errno."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.errno = code


def read_reply(dest: int, op: int, raw: Wire) -> Frame:
    """The answer of rank `dest` to a request `op`: PeerError if it does not decode,
    RemoteError (with the peer's errno and message) if it is an error reply."""
    opname = OP_NAMES.get(op, str(op))
    try:
        resp = decode(raw)
    except ProtocolError as e:
        raise PeerError(f"rank {dest} sent a malformed {opname} reply: {e}") from None
    if resp.err:
        msg = bytes(resp.body).decode(errors="replace") or os.strerror(resp.err)
        raise RemoteError(f"rank {dest} {opname}: {msg}", resp.err)
    return resp


class _Waiter:
    __slots__ = ("event", "data", "error")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.data: Wire | None = None
        self.error: str | None = None


class Transport(Protocol):
    """Requests to other ranks, and serving theirs: `MpiTransport`, or `NoPeers` for one rank."""

    rank: int
    size: int
    bytes_sent: int
    bytes_received: int
    requests_in_flight: int
    peak_in_flight: int
    served: int

    async def run(self) -> None: ...

    async def request(self, dest: int, frame: Frame, timeout: float) -> Frame: ...


class NoPeers:
    """The transport of a single rank: nobody to ask (every request is a PeerError)."""

    rank = 0
    size = 1
    bytes_sent = bytes_received = requests_in_flight = peak_in_flight = served = 0

    async def run(self) -> None:
        return None

    async def request(self, dest: int, frame: Frame, timeout: float) -> Frame:
        raise PeerError(f"there is no rank {dest}: this mount has one rank")


def lower_timer_slack(slack_ns: int = 1000) -> None:
    """Let the calling thread's timed waits end when asked (proc(5), timerslack_ns): Linux adds
    50 us of slack to every timed sleep of a thread by default, as long as a poll of the MPI
    thread. Nothing changes where the file is missing or refused."""
    path = f"/proc/{threading.get_native_id()}/timerslack_ns"
    with contextlib.suppress(OSError), open(path, "w") as f:
        f.write(str(slack_ns))


class _Expected:
    """A low estimate of how long something takes (a round trip, the gap between requests),
    for the MPI thread to sleep through most of it instead of polling: each poll is a wake-up
    that costs tens of microseconds of CPU and contends with trio for the GIL
    (`python -m bench.cost` shows the CPU per remote file and the latency).

    The estimate is a little under the last time measured while the thread polled for the
    event. An event already there at the first poll after a sleep to its expected time may
    have waited: the estimate then shrinks by a fifth, until the thread wakes before the events
    again. Events that come irregularly keep it short (polling as without it)."""

    FIRST = 100e-6  # the estimate before anything was measured
    LONGEST = 1e-3  # one sleep is never longer

    def __init__(self) -> None:
        self.estimate = self.FIRST
        self.first_poll = False  # the coming poll is the first after a sleep to the expected time

    def observe(self, took: float) -> None:
        if self.first_poll:
            self.estimate *= 0.8
        else:
            self.estimate = min(self.LONGEST, 0.9 * took)

    def wait(self, since: float, now: float) -> float:
        """Seconds from `now` to the expected time, counted from `since` (0: shorter than a
        poll's first interval)."""
        w = min(self.LONGEST, since + self.estimate - now)
        return w if w >= POLL_FIRST else 0.0


class ReplyClock(_Expected):
    """When the replies this rank waits for are due: the oldest request's send plus the
    expected round trip (mostly the peer's work, a disk read)."""

    def __init__(self) -> None:
        super().__init__()
        self._sent: dict[int, float] = {}  # request id -> when sent, oldest first

    def sent(self, rid: int) -> None:
        self._sent[rid] = time.monotonic()

    def answered(self, rid: int) -> None:
        t = self._sent.pop(rid, None)
        if t is not None:
            self.observe(time.monotonic() - t)

    def awaiting(self, pending: Container[int]) -> bool:
        """A reply is still due: a request sent and not answered that trio still waits for
        (`pending`; one that timed out is never answered)."""
        while self._sent and next(iter(self._sent)) not in pending:
            del self._sent[next(iter(self._sent))]
        return bool(self._sent)

    def sleep(self, now: float) -> float:
        """Seconds until the oldest awaited reply is expected (0: it is due now)."""
        return self.wait(next(iter(self._sent.values())), now) if self._sent else 0.0


class RequestClock(_Expected):
    """When peers' next request is due: the last one's arrival plus the expected gap. A reader
    that reads one file after another sends its requests at a steady pace; several readers
    make the gaps short and irregular, and the thread polls as without it."""

    def __init__(self) -> None:
        super().__init__()
        self.last = -math.inf  # when a peer's request last arrived

    def arrived(self) -> None:
        now = time.monotonic()
        self.observe(now - self.last)
        self.last = now

    def sleep(self, now: float) -> float:
        """Seconds until the next request is expected (0: it is due now)."""
        return self.wait(self.last, now)


class MpiTransport:
    def __init__(self, comm: Any, handlers: HandlerTable):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.handlers = handlers
        self.bytes_sent = 0
        self.bytes_received = 0
        self.requests_in_flight = 0
        self.peak_in_flight = 0
        self.served = 0
        self.served_inline = 0  # answered on the MPI thread (page cache)
        self.served_by_io = 0  # answered by a disk thread of the transport
        self.polls = 0  # iterations of the MPI thread's loop
        self.waits_blocked = 0  # replies waited for with the event loop blocked
        self.waits_yielded = 0  # ...and those waits that gave the event loop back
        # append/popleft are thread-safe
        self._outq: deque[tuple[int, int, Wire, int]] = deque()
        # Released by a post, taken by the MPI thread's wait: a binary semaphore (a Lock may be
        # released by any thread), one futex call each way where an Event is several Python
        # lock operations under its Condition.
        self._wake = threading.Lock()
        self._wake.acquire()
        self._stop = threading.Event()
        self._pending: dict[int, _Waiter] = {}
        self._sync: dict[int, list[Wire | None]] = {}  # request id -> slot of a blocked wait
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # a blocked wait's reply
        self._poller = select.poll()
        self._poller.register(self._efd, select.POLLIN)
        self._session_fd: int | None = None
        self._blocking_off = 0  # requests still to wait for through trio (BLOCKING_OFF)
        self._ids = itertools.count(1)
        self._token: trio.lowlevel.TrioToken | None = None
        self._truncates = True  # the library drops what a short receive leaves (see _oversized)
        self._req_send: trio.MemorySendChannel[tuple[int, Wire]] | None = None
        self._ready = trio.Event()

    # ------------------------------------------------------------ trio side

    async def run(self) -> None:
        """Start the MPI thread and serve incoming requests until cancelled."""
        self._token = trio.lowlevel.current_trio_token()
        send, recv = trio.open_memory_channel[tuple[int, Wire]](math.inf)
        self._req_send = send
        thread = threading.Thread(target=self._mpi_loop, name="fanstore-mpi", daemon=True)
        thread.start()
        self._ready.set()
        limiter = trio.Semaphore(MAX_SERVING)
        try:
            async with trio.open_nursery() as nursery:
                async for source, raw in recv:
                    await limiter.acquire()
                    nursery.start_soon(self._serve_one, source, raw, limiter)
        finally:
            self._stop.set()
            self._notify()
            # Shielded: run() ends by cancellation, and the thread must have stopped before the
            # daemon goes on to MPI_Finalize. Bounded: MPICH retries a send to a dead peer
            # inside the call, and a daemon must still unmount and clean up (the thread is a
            # daemon thread, left behind).
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(thread.join, STOP_JOIN)
            if thread.is_alive():
                log.error("the MPI thread did not stop within %g s (an MPI call to a dead "
                          "peer?); unmounting without it", STOP_JOIN)

    async def _serve_one(self, source: int, raw: Wire, limiter: trio.Semaphore) -> None:
        try:
            reply = await self.handlers.dispatch(source, bytes(raw))
            self.served += 1
            self._post(source, TAG_RESPONSE, reply, 0)
        finally:
            limiter.release()

    def _serve_blocking(self, source: int, raw: Wire) -> None:
        """An inline request that must wait on the disk, in a worker thread (no trio hop)."""
        reply = self.handlers.dispatch_inline(source, raw, MAX_FRAME)
        assert reply is not None  # no limit: a handler answers or fails, never defers
        self.served += 1
        self.served_by_io += 1
        self._post(source, TAG_RESPONSE, reply, 0)

    def _post(self, dest: int, tag: int, data: Wire, req_id: int) -> None:
        self._outq.append((dest, tag, data, req_id))
        self._notify()

    def _notify(self) -> None:
        """Wake the MPI thread (it checks the queue again before every wait)."""
        with contextlib.suppress(RuntimeError):  # not taken: a wake-up is pending already
            self._wake.release()

    async def request(self, dest: int, frame: Frame, timeout: float) -> Frame:
        """Send `frame` to rank `dest` and wait for its answer (PeerError on timeout)."""
        await self._ready.wait()
        rid = next(self._ids)
        frame.req_id = rid
        w = _Waiter()
        self.requests_in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.requests_in_flight)
        try:
            if self._can_block():
                data = self._wait_blocking(dest, frame, rid, w)
                if data is not None:
                    return read_reply(dest, frame.op, data)
            else:
                self._pending[rid] = w
                self._post(dest, TAG_REQUEST, frame.encode(), rid)
            with trio.move_on_after(timeout):
                await w.event.wait()
        finally:
            self.requests_in_flight -= 1
            self._pending.pop(rid, None)
        if not w.event.is_set():
            opname = OP_NAMES.get(frame.op, str(frame.op))
            raise PeerError(f"rank {dest} did not answer {opname} within {timeout:g} s")
        if w.error is not None:
            raise PeerError(f"rank {dest}: {w.error}")
        assert w.data is not None
        return read_reply(dest, frame.op, w.data)

    def watch_session(self, fd: int) -> None:
        """Let a lone request block the event loop until its reply comes or the kernel queues
        another FUSE request on `fd` (the FUSE session's device), whichever is first."""
        self._poller.register(fd, select.POLLIN)
        self._session_fd = fd

    def _can_block(self) -> bool:
        """Nothing else for trio to do: this is the only request in flight and no task is
        runnable (a FUSE request queued meanwhile ends the wait, `_wait_blocking`)."""
        if self._session_fd is None or self.requests_in_flight != 1:
            return False
        if self._blocking_off:  # a recent blocked wait ended without its reply
            self._blocking_off -= 1
            return False
        st = trio.lowlevel.current_statistics()
        return st.tasks_runnable == 0 and st.run_sync_soon_queue_size == 0

    def _wait_blocking(self, dest: int, frame: Frame, rid: int, w: _Waiter) -> Wire | None:
        """Post the request and wait for its reply on this thread, without a turn of the event
        loop (`run_sync_soon`'s wake-up of trio and its scheduling cost more CPU than a wake-up
        from poll: docs/performance.md, open miss 2). None when a FUSE request came first, a
        peer's request for trio came (it may be what the reply waits for), or SYNC_WAIT_MS
        passed: `w` then gets the reply (or the error of a send that failed) through trio."""
        raw = frame.encode()  # may raise: nothing registered yet
        # The count of an earlier wait's reply (taken from its slot before the eventfd was
        # read) or of a batch handed to trio: this wait must see only its own.
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._efd)
        slot: list[Wire | None] = [None]
        self._sync[rid] = slot
        self._post(dest, TAG_REQUEST, raw, rid)
        ready = self._poller.poll(SYNC_WAIT_MS)
        self._pending[rid] = w  # before the slot is taken back: a later reply goes to `w`
        if self._sync.pop(rid, None) is not None:
            self.waits_yielded += 1
            if not ready or any(fd == self._session_fd for fd, _ in ready):
                # a FUSE request came (several readers: their requests overlap), or the
                # reply is slow; not when a peer's request for trio ended the wait
                self._blocking_off = BLOCKING_OFF
            return None
        self.waits_blocked += 1
        # The MPI thread took the slot: the reply is in it, or is about to be (it fills the
        # slot, then writes the eventfd; a count left over is drained by the next wait).
        while slot[0] is None:
            try:
                os.eventfd_read(self._efd)
            except BlockingIOError:
                select.select([self._efd], [], [])
        return slot[0]

    def __contains__(self, rid: object) -> bool:
        """A request whose reply is still waited for (by trio, or by its blocked thread)."""
        return rid in self._pending or rid in self._sync

    def _deliver(self, batch: list[tuple[int, int, Wire]]) -> None:
        """Frames the MPI thread received in one wake-up, handed over in one call."""
        for source, tag, buf in batch:
            if tag == TAG_REQUEST and self._req_send is not None:
                self._req_send.send_nowait((source, buf))
            elif tag == TAG_RESPONSE:
                w = self._pending.get(request_id_of(buf))
                if w is not None:
                    w.data = buf
                    w.event.set()

    def _send_failed(self, req_id: int, message: str) -> None:
        w = self._pending.get(req_id)
        if w is not None:
            w.error = message
            w.event.set()

    # ------------------------------------------------------------ the MPI thread

    def _oversized(self, msg: Any, source: int, tag: int, n: int, byte: Any,
                   mpi_error: type[Exception]) -> None:
        """A frame over MAX_FRAME from rank `source`: receive only its header (MPI reports the
        truncation and drops the rest), log one line, fail the request it answers or answer
        the request it makes with EPROTO. Open MPI 4's shared-memory single copy cannot
        truncate a receive (it faults and kills the receiver): there the frame is received
        whole into an anonymous mapping and unmapped at once, never into the heap."""
        head = bytearray(HEADER.size)
        if self._truncates:
            with contextlib.suppress(mpi_error):
                msg.Recv([head, len(head), byte])
        else:
            scratch = mmap.mmap(-1, n)
            try:
                with contextlib.suppress(mpi_error):
                    msg.Recv([scratch, n, byte])
                head[:] = scratch[: len(head)]
            finally:
                scratch.close()
        why = f"rank {source} sent a frame of {n} bytes, over the limit of {MAX_FRAME}"
        log.error("%s; dropped", why)
        rid = request_id_of(head)
        if tag == TAG_RESPONSE:
            token = self._token
            if token is not None and rid:
                token.run_sync_soon(self._send_failed, rid, why)
        elif tag == TAG_REQUEST:
            err = Frame(0, rid, err=errno.EPROTO, body=why.encode())
            self._outq.append((source, TAG_RESPONSE, err.encode(), 0))

    def _next_wait(self, delay: float, sending: bool, reply: ReplyClock,
                   request: RequestClock) -> float:
        """How long the MPI thread sleeps once its poll found nothing more to receive or post
        (`delay`: the previous sleep, 0 after traffic or a post from trio). An awaited reply
        and, for IDLE_AFTER after the last, a peer's next request are slept for until they are due
        (`ReplyClock`, `RequestClock`), then polled for from POLL_FIRST up to POLL_MAX, as is a
        send that must progress (rendezvous); otherwise the thread idles. A post from trio ends
        any sleep at once."""
        now = time.monotonic()
        reply.first_poll = request.first_poll = False  # used up by this poll, whatever it found
        awaiting = reply.awaiting(self)
        serving = now - request.last < IDLE_AFTER
        if awaiting or serving or sending:
            if delay or sending:
                return min(POLL_MAX, delay * POLL_GROWTH) if delay else POLL_FIRST
            r = reply.sleep(now) if awaiting else math.inf
            q = request.sleep(now) if serving else math.inf
            wait = min(r, q)
            reply.first_poll, request.first_poll = 0 < r == wait, 0 < q == wait
            return wait or POLL_FIRST
        quiet = now - request.last
        return DEEP_IDLE_SLEEP if quiet > DEEP_IDLE_S else IDLE_SLEEP

    def _mpi_loop(self) -> None:
        from mpi4py import MPI

        comm = self.comm
        status = MPI.Status()
        sends: list[Any] = []  # requests of sends not complete when posted (rendezvous)
        bufs: list[Wire] = []  # their buffers, alive until they complete
        token = self._token
        assert token is not None
        outq, handlers = self._outq, self.handlers
        any_source, any_tag, byte = MPI.ANY_SOURCE, MPI.ANY_TAG, MPI.BYTE
        self._truncates = not MPI.Get_library_version().startswith("Open MPI")
        pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="fanstore-mpi-io",
                                  initializer=name_this_thread)
        reading: list[Future[None]] = []  # requests the disk threads serve
        lower_timer_slack()
        name_this_thread()
        delay = 0.0
        replies, requests = ReplyClock(), RequestClock()

        def send_queued() -> bool:
            """Post every queued frame (trio's, and replies made on this thread)."""
            posted = False
            while outq:
                dest, tag, data, rid = outq.popleft()
                posted = True
                try:
                    req = comm.Isend([data, byte], dest=dest, tag=tag)
                    self.bytes_sent += len(data)
                    if tag == TAG_REQUEST:
                        replies.sent(rid)
                    if not req.Test():  # an eager send is complete at once: nothing to track
                        sends.append(req)
                        bufs.append(data)
                except MPI.Exception as e:
                    log.error("send to rank %d failed: %s", dest, e)
                    if rid:
                        token.run_sync_soon(self._send_failed, rid, f"send failed: {e}")
            return posted

        while not self._stop.is_set():
            self.polls += 1
            busy = send_queued()
            batch: list[tuple[int, int, Wire]] = []
            disk = INLINE_DISK_BYTES if all(f.done() for f in reading) else 0
            drained = False  # a probe found nothing more: no need to poll again at once
            for _ in range(64):
                msg = comm.improbe(any_source, any_tag, status)
                if msg is None:  # a second progress may complete what the first began
                    msg = comm.improbe(any_source, any_tag, status)
                if msg is None:
                    drained = True
                    break
                busy = True
                n = status.Get_count(byte)
                source, tag = status.Get_source(), status.Get_tag()
                if n > MAX_FRAME:  # never allocated: received cut to its header, answered
                    self._oversized(msg, source, tag, n, byte, MPI.Exception)
                    continue
                buf = alloc(n)
                msg.Recv([buf, byte])
                self.bytes_received += n
                if tag == TAG_RESPONSE:
                    rid = request_id_of(buf)
                    replies.answered(rid)
                    slot = self._sync.pop(rid, None)
                    if slot is not None:  # its trio thread waits for it (`_wait_blocking`)
                        slot[0] = buf
                        os.eventfd_write(self._efd, 1)
                        continue
                else:
                    requests.arrived()
                if tag == TAG_REQUEST and handlers.is_inline(buf):
                    # answered here from the page cache, or by a worker thread that reads the
                    # disk: either way without a hop to trio and back
                    reply = handlers.dispatch_inline(source, buf, disk)
                    disk = 0  # one disk read here per poll at most: the next ones may wait
                    if reply is None:
                        reading = [f for f in reading if not f.done()]
                        reading.append(pool.submit(self._serve_blocking, source, buf))
                    else:
                        self.served += 1
                        self.served_inline += 1
                        outq.append((source, TAG_RESPONSE, reply, 0))
                    continue
                batch.append((source, tag, buf))
            if batch:
                try:
                    token.run_sync_soon(self._deliver, batch)
                except trio.RunFinishedError:
                    break
                if self._sync:  # trio waits blocked: these may be what its reply waits for
                    os.eventfd_write(self._efd, 1)
            busy = send_queued() or busy  # the replies made above go out in this turn
            if sends:
                done = MPI.Request.Testsome(sends)
                if done:
                    busy = True
                    for i in sorted(done, reverse=True):
                        del sends[i]
                        del bufs[i]
            if outq or not drained:  # more to post or to receive: poll again at once
                delay = 0.0
                continue
            # Traffic in this turn: the next wait is counted from it (the clocks), else the
            # poll found nothing and the wait grows.
            delay = self._next_wait(0.0 if busy else delay, bool(sends), replies, requests)
            if self._wake.acquire(True, delay):  # a post, not the time something was due
                delay = 0.0
                replies.first_poll = requests.first_poll = False
        pool.shutdown(wait=False, cancel_futures=True)
        # Let queued sends finish briefly so peers get their answers.
        deadline = time.monotonic() + 1.0
        while sends and time.monotonic() < deadline:
            done = MPI.Request.Testsome(sends)
            for i in sorted(done or [], reverse=True):
                del sends[i]
                del bufs[i]
            time.sleep(0.001)
