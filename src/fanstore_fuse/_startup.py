"""The start-up phases of a mount daemon before FUSE: the manifest, the placement exchange, the
stage-in, each timed (`Phases`); and the bound on the manifest's mapped pages afterwards
(`MappedPages`). No pyfuse3 here; `_daemon` runs these and mounts."""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio

from ._blobstore import BlobStore, DenseMap
from ._errors import FormatError
from ._format import Manifest
from ._fsio import atomic_write
from ._manifest import finish_manifest, header_digest, read_manifest, trim_heap
from ._ring import LocalOnlyPlacement, Locator, Placement
from ._ring_np import blobs_by_rank
from ._stage import (
    Ranges,
    StageResult,
    broadcast_mask,
    plan_dense,
    stage_in,
    stage_manifest,
)
from ._validate import check_children

log = logging.getLogger("fanstore_fuse.daemon")


class PeerFailed(Exception):
    """Another rank failed before the placement exchange (it reports its own error)."""


class Exchange:
    """The split of start-up work between ranks: each rank validates 1/N of the manifest and
    hashes the placement of 1/N of the blob ids; one alltoall swaps the blob lists together
    with each rank's validation result (its copy's header digest and its share's count of
    listed children), so no rank validates or hashes everything. Every rank calls it exactly
    once, a rank that failed earlier with `fail()`, so the collective never waits forever."""

    def __init__(self, comm: Any, nranks: int):
        self.comm, self.nranks, self.done = comm, nranks, False

    def blobs(self, manifest: Manifest, placement: Placement, rank: int, children: int
              ) -> np.ndarray:
        n, k = manifest.n_blobs, self.nranks
        lists = blobs_by_rank(placement, n * rank // k, n * (rank + 1) // k, broadcast_mask(manifest))
        checked = (header_digest(manifest), children)
        got = self._swap([(checked, x) for x in lists])
        if any(g is None for g in got):
            raise PeerFailed
        if len({g[0][0] for g in got}) != 1:
            raise FormatError("the ranks copied different manifests (DEST changed during the mount)")
        check_children(sum(g[0][1] for g in got), manifest.n_entries)
        return np.concatenate([g[1] for g in got])

    def fail(self) -> None:
        if not self.done and self.nranks > 1:
            self._swap([None] * self.nranks)

    def _swap(self, out: list[Any]) -> list[Any]:
        self.done = True
        return self.comm.alltoall(out)


class Phases:
    """Wall and CPU seconds of each start-up phase, logged in one line (docs/performance.md)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.last = (time.perf_counter(), time.process_time())
        self.parts = [f"process start to here {_age():.3f}/{self.last[1]:.3f}"]

    def __call__(self, what: str) -> None:
        now = (time.perf_counter(), time.process_time())
        self.parts.append(f"{what} {now[0] - self.last[0]:.3f}/{now[1] - self.last[1]:.3f}")
        self.last = now

    def report(self) -> None:
        log.info("rank %d start-up, wall/CPU s: %s", self.rank, ", ".join(self.parts))


def _age() -> float:
    """Seconds since this process started (start time from /proc; 0 where there is none)."""
    try:
        with open("/proc/self/stat") as f:
            start = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - start
    except (OSError, ValueError, IndexError):
        return 0.0


def progress_writer(path: str | None, total: int) -> Callable[[int], None] | None:
    """A stage-in progress callback writing "done total" to `path` (for the launcher's bar)."""
    if not path:
        return None
    done = 0
    last = 0.0

    def tick(n: int) -> None:
        nonlocal done, last
        done += n
        now = time.monotonic()
        if now - last > 0.1 or done >= total:
            last = now
            with contextlib.suppress(OSError):
                atomic_write(path, f"{done} {total}\n", durable=False)

    tick(0)
    return tick


@dataclass
class Staged:
    """What the staging phases leave: the mapped manifest, where everything lives, the blob
    store over the local copies, and the held counts for `status`."""

    manifest: Manifest
    placement: Locator
    store: BlobStore
    held: dict[str, int]


def stage(dest: str, local: str, rank: int, nranks: int, replicas: int, exchange: Exchange,
          clock: Phases, progress_file: str | None) -> Staged:
    """Copy and check the manifest, place the blobs (ranks > 1), stage in this rank's share.
    One rank copies every partition whole while the manifest is validated (the copy needs only
    the partition table, checked first); nothing is served before both finished."""
    copy = stage_manifest(dest, local)
    clock("manifest copy")
    manifest = read_manifest(copy, validate=False)
    clock("manifest checksums")
    parts = manifest.partitions
    placement = Placement(nranks, replicas, is_broadcast=_broadcast(manifest))
    shares: dict[int, Ranges | None] | None = None
    dense: DenseMap | None = None
    if nranks > 1:
        children = finish_manifest(manifest, rank, nranks)
        clock(f"manifest check (1/{nranks})")
        held = exchange.blobs(manifest, placement, rank, children)
        clock("placement")
        shares, dense = plan_dense(manifest, held)
        clock("share plan")
    total = sum(parts[p].size if r is None else int(r[:, 1].sum())
                for p, r in (shares or {p: None for p in range(len(parts))}).items())
    progress = progress_writer(progress_file, total) if rank == 0 else None
    t0 = time.perf_counter()
    if nranks > 1:
        res = stage_in(dest, local, manifest, shares, progress=progress)
    else:
        res = _stage_validating(dest, local, manifest, progress)
        held = np.arange(manifest.n_blobs)
    dt = time.perf_counter() - t0
    counts = {
        "blobs_held": len(held),
        "bytes_held": int(np.frombuffer(manifest.blobs["raw"], "<u4")[held].sum(dtype=np.uint64)),
        "staged_bytes": res.bytes,
        "stage_in_us": int(dt * 1e6),
    }
    del held, shares, progress
    trim_heap()  # the placement lists, the copy ranges (16 B per held blob), the copy threads'

    log.info("rank %d staged %d partitions, %d bytes into %s in %.3f s (%.0f MB/s)", rank,
             res.partitions, res.bytes, local, dt, res.bytes / max(dt, 1e-9) / 1e6)
    clock("stage-in" if nranks > 1 else "manifest check + stage-in (overlapped)")
    return Staged(manifest, placement if nranks > 1 else LocalOnlyPlacement(),
                  BlobStore(manifest, local, dense), counts)


def _broadcast(manifest: Manifest) -> Callable[[int], bool]:
    parts, bpart = manifest.partitions, manifest.blobs["part"]
    return lambda b: parts[bpart[b]].broadcast


def _stage_validating(dest: str, local: str, manifest: Manifest,
                      progress: Callable[[int], None] | None) -> StageResult:
    """Every partition whole, copied in a thread (copy_file_range: the GIL is free) while this
    thread validates the manifest; a validation error wins over a copy error."""
    with ThreadPoolExecutor(1, thread_name_prefix="stage-all") as pool:
        copying = pool.submit(stage_in, dest, local, manifest, None, progress=progress)
        try:
            finish_manifest(manifest)
        except BaseException:
            with contextlib.suppress(Exception):
                copying.result()
            raise
        return copying.result()


def _rss_file() -> int:
    """Resident file-backed bytes of this process (`RssFile` of /proc/self/status; 0 if none)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssFile:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return 0


class MappedPages:
    """Keeps the pages of the mapped manifest that this process holds under `budget` bytes.

    Lookups and listings touch the manifest's pages through the mapping; a page once touched
    stays mapped, counted as this process's private memory (one rank per node maps its copy
    alone), so after a full walk of a 14M-entry dataset a daemon would hold ~1.4 GB of it. The
    pages are the page cache's: `MADV_DONTNEED` on a shared read-only file mapping only unmaps
    them (the next touch is a minor fault, no I/O). `drop()` at ready lets go of what start-up
    touched; `run()` checks `RssFile` every `period` s (a 2 KB read) and drops the mapping's
    pages, in a thread, 64 MiB per call, once it grew more than `budget` above the level at
    ready (with fault-around, 3 s of random lookups map ~100 MB: a 1 s period was too slow)."""

    def __init__(self, manifest: Manifest, budget: int = 8 << 20, period: float = 0.25):
        self.manifest = manifest
        self.mm: mmap.mmap | None = manifest._keep if isinstance(manifest._keep, mmap.mmap) else None
        self.budget, self.period = budget, period
        self.base = 0
        self.drops = 0

    def drop(self) -> None:
        if self.mm is None:
            return
        with contextlib.suppress(ValueError, OSError):  # closed at unmount
            self.manifest.drop_pages()
        self.drops += 1

    def ready(self) -> None:
        self.drop()
        self.base = _rss_file()

    async def run(self) -> None:
        if self.mm is None:
            return
        while True:
            await trio.sleep(self.period)
            if _rss_file() > self.base + self.budget:
                await trio.to_thread.run_sync(self.drop)
