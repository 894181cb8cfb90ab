"""Node and BlobCache in process (no mount): the cache's sharing of fetches and its failures."""

from __future__ import annotations

import pytest
import trio

from fanstore_fuse._errors import ChecksumError
from fanstore_fuse._node import BlobCache, Stats


class ScriptedSource:
    """Fetches that answer from a script: an exception or bytes per call, each released by hand."""

    def __init__(self, answers: list[bytes | Exception]):
        self.answers = list(answers)
        self.calls = 0
        self.release = trio.Event()

    async def fetch(self, blob: int) -> bytes:
        self.calls += 1
        answer = self.answers.pop(0)
        await self.release.wait()
        if isinstance(answer, Exception):
            raise answer
        return answer


async def test_concurrent_readers_share_one_fetch():
    src = ScriptedSource([b"data"])
    cache = BlobCache(src.fetch, Stats(), 1 << 20)
    got: list[bytes] = []

    async def reader() -> None:
        got.append(await cache.get(7))

    async with trio.open_nursery() as n:
        for _ in range(5):
            n.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        src.release.set()
    assert got == [b"data"] * 5 and src.calls == 1


async def test_failed_fetch_then_successful_fetch_gives_the_waiter_the_bytes():
    """A failure nobody waited for must not be handed to a waiter of a later, good fetch."""
    src = ScriptedSource([ChecksumError("first fetch fails"), b"ok"])
    src.release.set()
    cache = BlobCache(src.fetch, Stats(), 1 << 20)
    with pytest.raises(ChecksumError):
        await cache.get(3)  # fails with no waiter
    src.release = trio.Event()
    results: dict[str, object] = {}

    async def fetcher() -> None:
        results["fetcher"] = await cache.get(3)

    async def waiter() -> None:
        try:
            results["waiter"] = await cache.get(3)
        except ChecksumError as e:
            results["waiter"] = e

    async with trio.open_nursery() as n:
        n.start_soon(fetcher)
        await trio.testing.wait_all_tasks_blocked()
        n.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        src.release.set()
    assert results == {"fetcher": b"ok", "waiter": b"ok"}


async def test_waiters_of_a_failed_fetch_get_its_error_and_the_next_read_retries():
    src = ScriptedSource([ChecksumError("bad copy"), b"good"])
    stats = Stats()
    cache = BlobCache(src.fetch, stats, 1 << 20)
    errors: list[Exception] = []

    async def reader() -> None:
        try:
            await cache.get(1)
        except ChecksumError as e:
            errors.append(e)

    async with trio.open_nursery() as n:
        for _ in range(3):
            n.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        src.release.set()
    assert len(errors) == 3 and src.calls == 1
    assert await cache.get(1) == b"good"
    assert src.calls == 2 and stats.errors == 1
