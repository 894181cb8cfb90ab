"""A light worker pool for short blocking calls from trio (frame reads, checks).

`trio.to_thread.run_sync` hands each call to a thread through a cache of idle threads and a
capacity limiter; persistent threads fed by a `queue.SimpleQueue` and waking the task with
`TrioToken.run_sync_soon` do the same work with about half its CPU per call (compare with
`python -m bench.smallfile`'s cold cells, daemon CPU per file). Like `to_thread.run_sync` by
default, a call cannot be cancelled once submitted; exceptions travel back to the caller.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

from ._fsio import name_this_thread

T = TypeVar("T")


class Workers:
    def __init__(self, n: int = 0):
        self.n = n or max(16, (os.cpu_count() or 1) * 2)  # mostly waiting on the disk
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._started = 0
        self._lock = threading.Lock()

    def _work(self) -> None:
        name_this_thread()
        while True:
            token, task, fn, args = self._q.get()
            res = outcome.capture(fn, *args)
            with contextlib.suppress(trio.RunFinishedError):  # the run ended: nobody to wake
                token.run_sync_soon(trio.lowlevel.reschedule, task, res)

    def _start(self) -> None:
        with self._lock:
            while self._started < self.n:
                self._started += 1
                threading.Thread(target=self._work, name="fanstore-io", daemon=True).start()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in a worker thread; the event loop keeps running meanwhile."""
        if self._started < self.n:
            self._start()
        await trio.lowlevel.checkpoint_if_cancelled()
        self._q.put((trio.lowlevel.current_trio_token(), trio.lowlevel.current_task(), fn, args))
        res: T = await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)
        return res


WORKERS = Workers()  # one pool per process (threads start at the first call)
