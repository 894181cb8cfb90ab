"""READ of dataset files answered in C, by the `_noflush` shim (`_shim_blobs.c`,
`_shim_read.c`; issue 11).

`hold_blobs(store)` hands the shim the manifest's blob columns, the zstd dictionary and this
rank's local copies (a descriptor per partition present in the local dir, the `DenseMap` of a
rank holding a share) once, before the session serves: the shim can then read, decode and
verify any blob held here without Python. `enable` (before `pyfuse3.init`) and `start` (in the
trio run, where the Python fallback gets its token) switch the READ patch on: a READ of a
dataset file whose bytes are all held here is answered by the shim's threads; anything else
(written files, blobs of other ranks, large non-framed blobs) goes to `Operations.read` as
before. When C fails (checksum, short read, decode), it calls `_fallback`, which does the read
the Python way on the trio thread (logging, counting, replicas, EIO) and C replies with that.
Decoded zstd frames read in part are kept in C (`_shim_fcache.c`, up to the daemon's
`FANSTORE_CACHE_BYTES`) and, after a buffered READ, pushed into the kernel's page cache
(`_shim_push.c`); `counts` reports both (`c_frame_*`).
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Awaitable, Callable

import pyfuse3
import trio

from . import _fastclose
from ._blobstore import BlobStore
from ._namespace import Namespace

log = logging.getLogger("fanstore_fuse.fastread")


def hold_blobs(store: BlobStore) -> None:
    """Hand the blob columns and the local copies under `store` to the shim (raises what the
    shim raises: ValueError, TypeError, BufferError, OSError); the shim must be loaded."""
    shim = _fastclose._shim
    assert shim is not None
    m, b = store.m, store.m.blobs
    cols = (b["part"], b["offset"], b["stored"], b["raw"], b["codec"], b["xxh3"])
    fds: list[int] = []
    try:
        for p in m.partitions:
            try:
                fds.append(os.open(os.path.join(store.local_dir, p.name), os.O_RDONLY | os.O_CLOEXEC))
            except OSError:
                fds.append(-1)  # not here: its blobs go to Python (remote, or EIO there)
        d = store.dense
        flags = bytes(int(d is not None and i in d.parts) for i in range(len(m.partitions)))
        ids = d.ids if d is not None else memoryview(b"").cast("Q")
        offs = d.offs if d is not None else memoryview(b"").cast("Q")
        chunk = int(m.options.get("chunk_size", 4 << 20))
        shim.hold_blobs(cols, len(b["part"]), chunk, m.zdict, fds, flags, ids, offs)
    finally:
        for fd in fds:
            if fd >= 0:
                os.close(fd)


class _Fallback:
    """What the shim's threads call (GIL taken) when C cannot answer a READ it took: the same
    read through `Operations.read` on the trio thread; bytes, or the errno it gave."""

    def __init__(self, read: Callable[[int, int, int], Awaitable[bytes]],
                 token: trio.lowlevel.TrioToken):
        self.read = read
        self.token = token
        self.calls = 0

    def __call__(self, fh: int, off: int, size: int) -> bytes | int:
        self.calls += 1
        try:
            return trio.from_thread.run(self.read, fh, off, size, trio_token=self.token)
        except pyfuse3.FUSEError as e:
            return e.errno
        except trio.RunFinishedError:
            return errno.EIO  # unmounting
        except Exception:
            log.exception("C read fallback of handle %d failed", fh)
            return errno.EIO


_enabled = False


def enable(ns: Namespace, store: BlobStore, threads: int, inline_max: int,
           frame_cache: int = 0, push: bool = False, subblocks: bool = True) -> bool:
    """Hold the entry columns (`_fastclose.hold_dataset`) and the blobs, and patch READ
    (`threads` reader threads; READs of at most `inline_max` bytes first tried from the page
    cache on the FUSE thread; decoded zstd frames, and with `subblocks` raw sub-blocks, kept
    up to `frame_cache` bytes, and with `push` stored in the kernel's page cache after a
    buffered READ of part of one). Before
    pyfuse3.init; serving starts at `start`. False (one log line) without the shim."""
    global _enabled
    shim = _fastclose._shim
    if shim is None or not hasattr(shim, "fast_read"):
        log.info("dataset reads go through Python (%s)", _fastclose._why)
        return False
    try:
        _fastclose.hold_dataset(ns.m)
        hold_blobs(store)
        shim.fast_read(threads, inline_max)
        if hasattr(shim, "frame_cache"):
            shim.frame_cache(frame_cache, push, subblocks)
    except (ValueError, TypeError, BufferError, OSError) as err:
        log.warning("dataset reads go through Python: %s", err)
        return False
    _enabled = True
    return True


def start(read: Callable[[int, int, int], Awaitable[bytes]]) -> bool:
    """In the trio run (`Operations.init`): C answers READs from now on, `read`
    (`Operations.read`) as its fallback. Never raises; False when not enabled."""
    shim = _fastclose._shim
    if not _enabled or shim is None:
        return False
    try:
        shim.read_start(_Fallback(read, trio.lowlevel.current_trio_token()))
    except (ValueError, OSError, RuntimeError) as err:
        log.warning("dataset reads go through Python: %s", err)
        return False
    log.info("dataset reads answered by the C shim")
    return True


FRAME_COUNTS = ("c_frame_hits", "c_frame_misses", "c_frame_evictions", "c_frame_bytes",
                "c_frame_entries", "c_frame_budget", "c_frame_pushes", "c_frame_push_bytes",
                "c_frame_push_fails", "c_frame_push_drops")

STREAM_COUNTS = ("stream_runs", "stream_refused", "stream_windows", "stream_bytes", "stream_ns",
                 "stream_cold", "stream_cache_segments", "stream_cache_skipped", "stream_busy")


def counts() -> dict[str, int]:
    """READs the shim answered: `c_reads`, `c_read_bytes`, `c_read_inline` (from the page cache
    on the FUSE thread), `c_read_fallbacks` (handed to Python after an error in C); the frame
    cache's `c_frame_*` (hits, misses: lookups of part of a zstd frame; evictions; bytes and
    entries kept; budget; frames pushed to the page cache, their bytes, pushes the kernel
    refused, pushes dropped with the queue full); the streaming of local copies into the page
    cache (_shim_stream.c): `stream_runs`, `stream_refused` (too large for MemAvailable),
    `stream_windows` and `stream_bytes` read in, `stream_ns` spent streaming, `stream_cold`
    (blobs reads found cold: 16 since the last stream start one), `stream_cache_segments` /
    `stream_cache_skipped` (disk-cache segments streamed / left out: over the budget),
    `stream_busy` (1 while a stream is asked for or running);
    `c_mapread_reads` / `c_mapread_bytes`: large READs of raw frames answered from a mapping of
    the local copy (_shim_mapread.c); `c_direct_reads` / `c_direct_bytes`: cold small blobs read
    with O_DIRECT, `c_direct_gated`: nowait reads of them refused by the residency check
    without starting any I/O (_shim_blobs.c); `c_data_fresh` / `c_data_huge` / `c_data_pooled`:
    blocks of 1 MiB or more for blob bytes allocated afresh, of them advised MADV_HUGEPAGE, and
    taken again from the pool (_shim_frames.c)."""
    shim = _fastclose._shim
    if shim is None or not hasattr(shim, "read_counts"):
        return {}
    reads, nbytes, inline, fallbacks = shim.read_counts()
    out = {"c_reads": int(reads), "c_read_bytes": int(nbytes), "c_read_inline": int(inline),
           "c_read_fallbacks": int(fallbacks)}
    if hasattr(shim, "frame_counts"):
        out.update(zip(FRAME_COUNTS, map(int, shim.frame_counts())))
    if hasattr(shim, "stream_counts"):
        out.update(zip(STREAM_COUNTS, map(int, shim.stream_counts())))
    if hasattr(shim, "mapread_counts"):
        out.update(zip(("c_mapread_reads", "c_mapread_bytes"), map(int, shim.mapread_counts())))
    if hasattr(shim, "data_counts"):
        out.update(zip(("c_data_fresh", "c_data_huge", "c_data_pooled"),
                       map(int, shim.data_counts())))
    if hasattr(shim, "direct_counts"):
        out.update(zip(("c_direct_reads", "c_direct_bytes", "c_direct_gated"),
                       map(int, shim.direct_counts())))
    return out
