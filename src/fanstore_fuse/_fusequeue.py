"""Whether the kernel holds more FUSE requests for this daemon right now.

A small cold read is cheaper inline (a 16 KiB `pread`) than through a worker thread, but inline
it blocks the event loop: pyfuse3 reads the next request only when a handler yields. With one
reader at a time that costs nothing; with many requests queued (`fio --iodepth=16`, several
reader processes) it serialized every disk read behind the previous one (measured: a strict
read / pread / reply cycle in `strace`, 700-1,900 IOPS at depth 16 against 6,300 at depth 1).
`waiting()` polls the daemon's `/dev/fuse` descriptor with a zero timeout (a few us): when
another request is already there, the caller sends its disk read to a worker and lets the loop
take the next request, so queued reads overlap on the disk.

With the shim's request threads (`_shim_threads.c`, `FANSTORE_FUSE_THREADS`) the kernel's queue
is read at once by them: a request they hand to pyfuse3 waits in the shim's queue, so
`waiting()` asks the shim first (`fuse_queued()`).

The descriptor is looked for once, at the first call (the daemon calls it only for reads, after
it mounted), in /proc/self/fd (pyfuse3 does not expose it); a process without one (library
use, tests in process) never sees requests waiting.
"""

from __future__ import annotations

import os
import select

from . import _fastclose

_DEVICE = "/dev/fuse"
_queued = getattr(_fastclose._shim, "fuse_queued", None)  # requests the shim's threads queued


class FuseQueue:
    def __init__(self, device: str = _DEVICE) -> None:
        self.device = device  # what the descriptor to poll leads to (tests: a FIFO)
        self._poll: select.poll | None = None
        self._looked = False

    def _find(self) -> bool:
        try:
            names = os.listdir("/proc/self/fd")
        except OSError:
            return False
        for name in names:
            try:
                if os.readlink(f"/proc/self/fd/{name}") == self.device:
                    fd = int(name)
                    break
            except (OSError, ValueError):
                continue
        else:
            return False
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)
        return True

    def waiting(self) -> bool:
        """True when another FUSE request is queued for this process (never blocks)."""
        if _queued is not None and _queued():
            return True
        if self._poll is None:
            if self._looked:
                return False
            self._looked = True  # looked once, at the first read (the daemon has mounted)
            if not self._find():
                return False
        assert self._poll is not None
        try:
            return any(ev & select.POLLIN for _, ev in self._poll.poll(0))
        except OSError:
            return False


FUSE_QUEUE = FuseQueue()
