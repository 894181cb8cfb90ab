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


async def test_node_reads_across_chunks_and_reads_ahead(src_tree, tmp_path):
    from fanstore_fuse import PrepOptions, prep
    from fanstore_fuse._blobstore import BlobStore
    from fanstore_fuse._format import MANIFEST_NAME
    from fanstore_fuse._manifest import read_manifest
    from fanstore_fuse._namespace import Namespace
    from fanstore_fuse._node import LocalBlobSource, Node

    dest = tmp_path / "dest"
    # Whole-chunk blobs (no frames; tests/test_frames.py has the framed read path).
    prep(src_tree, dest, PrepOptions(partitions=2, chunk_size=1 << 20, frame_size=0))
    m = read_manifest(dest / MANIFEST_NAME)
    store = BlobStore(m, str(dest))
    stats = Stats()
    node = Node(Namespace(m), LocalBlobSource(store, stats, 256 << 10), stats, 64 << 20, 2)
    want = (src_tree / "big.bin").read_bytes()
    index = node.ns.resolve(b"big.bin")
    try:
        async with trio.open_nursery() as n:
            node.attach(n)
            assert await node.read(index, 0, 4096) == want[:4096]  # chunk 0; chunks 1, 2 ahead
            await trio.testing.wait_all_tasks_blocked()
            misses = stats.cache_misses
            assert misses == 3
            off = (1 << 20) - 100
            assert await node.read(index, off, 300) == want[off : off + 300]  # across a boundary
            assert await node.read(index, len(want) - 10, 100) == want[-10:]
            assert await node.read(index, len(want), 100) == b""
            assert stats.cache_misses == misses and stats.cache_hits >= 3
    finally:
        store.close()


def test_settings_are_read_from_the_environment_once_with_clear_errors():
    from fanstore_fuse._errors import FanstoreError
    from fanstore_fuse._settings import Settings

    s = Settings.from_env({"FANSTORE_CACHE_BYTES": "1048576", "FANSTORE_STARTUP_TIMEOUT": "1e2",
                           "FANSTORE_READAHEAD_CHUNKS": ""})
    assert (s.cache_bytes, s.startup_timeout, s.readahead_chunks) == (1 << 20, 100.0, 4)
    assert Settings.from_env({}) == Settings()
    with pytest.raises(FanstoreError, match="FANSTORE_READAHEAD_CHUNKS='fast' is not an integer"):
        Settings.from_env({"FANSTORE_READAHEAD_CHUNKS": "fast"})
    with pytest.raises(FanstoreError, match="must not be negative"):
        Settings.from_env({"FANSTORE_CACHE_BYTES": "-1"})
