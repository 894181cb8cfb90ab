"""Stage-in: copy (a rank's share of) the partitions from the shared DEST to node-local storage."""

from __future__ import annotations

import errno
import mmap
import os
import shutil
from array import array
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ._blobstore import DenseMap
from ._errors import FanstoreError, FormatError
from ._format import (
    ALIGN_MIN,
    DATA_ALIGN,
    MANIFEST_NAME,
    PARTITION_DATA_START,
    Manifest,
    check_partition_header,
)
from ._manifest import check_manifest_header, trim_heap

Ranges = np.ndarray  # k x 2 uint64: (offset, length) of each piece, in copy order
_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024


@dataclass
class StageResult:
    partitions: int
    bytes: int


def _copy_range(src_fd: int, dst_fd: int, off: int, n: int) -> None:
    end = off + n
    while off < end:
        try:
            k = os.copy_file_range(src_fd, dst_fd, end - off, off, off)
        except OSError as e:
            if e.errno in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                k = os.pwrite(dst_fd, os.pread(src_fd, min(end - off, 8 << 20), off), off)
            else:
                raise
        if k == 0:
            raise FanstoreError("source partition is shorter than the manifest says")
        off += k


def _copy_dense(sfd: int, dfd: int, ranges: Ranges, gap: int = 64 << 10, window: int = 8 << 20) -> int:
    """Append the byte `ranges` of `sfd`, in the order given, to `dfd`: nearby ranges are read
    with one pread (holes under `gap` bytes included) and written with one writev. The groups
    are found with numpy, a block of ranges at a time; Python only slices each piece. Reads go
    into one anonymous mapping per call, unmapped at the end: a copy thread's 8 MiB buffers
    would otherwise stay in its malloc arena, resident for the daemon's lifetime (~20 MB)."""
    copied = 0
    buf = _Buffer(window)
    try:
        for blk in range(0, len(ranges), 1 << 13):
            r = ranges[blk : blk + (1 << 13)].astype(np.int64)
            off, ln = r[:, 0], r[:, 1]
            end = off + ln
            # A new group wherever the next range starts before the previous end or too far after.
            brk = np.flatnonzero((off[1:] < end[:-1]) | (off[1:] - end[:-1] > gap)) + 1
            runs = np.r_[0, brk, len(r)].tolist()
            offs, lns, ends = off.tolist(), ln.tolist(), end.tolist()
            for ra, rz in zip(runs[:-1], runs[1:]):
                k = ra
                while k < rz:  # cut each run by the window and the iovec limit
                    j = int(np.searchsorted(end[k:rz], offs[k] + window, side="right")) + k
                    j = min(max(j, k + 1), k + _IOV_MAX, rz)
                    start, stop = offs[k], ends[j - 1]
                    mv = buf.view(stop - start)
                    if os.preadv(sfd, [mv], start) != stop - start:
                        raise FanstoreError("source partition is shorter than the manifest says")
                    pieces = [mv[o - start : o - start + n] for o, n in zip(offs[k:j], lns[k:j])]
                    want = sum(lns[k:j])
                    if os.writev(dfd, pieces) != want:
                        raise FanstoreError("short write to the local copy")
                    del pieces, mv
                    copied += want
                    k = j
    finally:
        buf.close()
    return copied


class _Buffer:
    """A read buffer in its own anonymous mapping, grown when a piece needs more."""

    def __init__(self, size: int):
        self.mm = mmap.mmap(-1, size)
        self.mv = memoryview(self.mm)

    def view(self, n: int) -> memoryview:
        if n > len(self.mm):
            self.close()
            self.__init__(n)  # type: ignore[misc]
        return self.mv[:n]

    def close(self) -> None:
        self.mv.release()
        self.mm.close()


def stage_partition(src: str, dst: str, size: int, ranges: Ranges | None) -> int:
    """Copy `src` to `dst`: all of it, or (dense) its header followed by the byte `ranges`,
    back to back in the order given (see `plan_dense` for the offsets this gives each blob)."""
    tmp = dst + ".part"
    sfd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if os.fstat(sfd).st_size != size:
            raise FanstoreError(
                f"partition {os.path.basename(src)} is {os.fstat(sfd).st_size} bytes, "
                f"manifest says {size}"
            )
        dfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            if ranges is None:
                _copy_range(sfd, dfd, 0, size)
                copied = size
            else:
                head = np.array([[0, PARTITION_DATA_START]], dtype=np.uint64)
                copied = _copy_dense(sfd, dfd, np.concatenate([head, ranges.astype(np.uint64)]))
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)
    os.replace(tmp, dst)
    return copied


def _np_col(col: object, dtype: str) -> np.ndarray:
    return np.frombuffer(memoryview(col).cast("B"), dtype=dtype)  # type: ignore[arg-type]


def broadcast_mask(manifest: Manifest) -> np.ndarray:
    """A bool per blob: in a broadcast partition (held by every rank). Partition numbers out of
    range (a manifest whose blob table another rank is still validating) count as not."""
    flags = np.array([p.broadcast for p in manifest.partitions] + [False], dtype=bool)
    return flags[np.minimum(_np_col(manifest.blobs["part"], "<u4"), len(flags) - 1)]


def _to_array(x: np.ndarray) -> array:
    a = array("Q")
    a.frombytes(x.astype("<u8").tobytes())
    return a


def _alignment_pads(so: np.ndarray, st: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Bytes to copy before each range (sorted by source offset `so`, lengths `st`, groups
    starting at `starts`, each group one local file from PARTITION_DATA_START on) so that every
    blob of ALIGN_MIN bytes or more keeps its source offset modulo DATA_ALIGN (prep's alignment
    of its data); smaller blobs are packed as they come. A blob's pad is the sum of the gaps in
    the source since the last such blob (or the group's start), modulo DATA_ALIGN: the range
    starts that much earlier in the source (never before byte 1: so >= 64, pad < 64)."""
    n = len(so)
    pad = np.zeros(n, np.int64)
    if not n:
        return pad
    prev_end = np.r_[PARTITION_DATA_START, so[:-1] + st[:-1]]
    prev_end[starts] = PARTITION_DATA_START
    gaps = so - prev_end
    cg = np.cumsum(gaps)
    big = st >= ALIGN_MIN
    idx = np.arange(n)
    last_big = np.r_[-1, np.maximum.accumulate(np.where(big, idx, -1))[:-1]]
    group = np.repeat(starts, np.diff(np.r_[starts, n]))
    ref = np.where(last_big >= group, cg[np.maximum(last_big, 0)], cg[group] - gaps[group])
    pad[big] = np.mod(cg - ref, DATA_ALIGN)[big]
    return pad


def plan_dense(manifest: Manifest, held: Iterable[int] | np.ndarray
               ) -> tuple[dict[int, Ranges | None], DenseMap]:
    """A rank's share: for each partition holding some of `held`, the source ranges to copy
    (sorted by source offset) and the local offset each blob gets in the dense copy; broadcast
    partitions are copied whole. Vectorized: no per-blob Python work but the range list."""
    parts = manifest.partitions
    bpart = _np_col(manifest.blobs["part"], "<u4")
    boff = _np_col(manifest.blobs["offset"], "<u8")
    bst = _np_col(manifest.blobs["stored"], "<u4")
    h = np.fromiter(held, dtype=np.int64) if not isinstance(held, np.ndarray) else held
    flags = np.array([p.broadcast for p in parts] or [False], dtype=bool)
    hp = bpart[h]
    keep = ~flags[hp]
    h, hp = h[keep], hp[keep]
    order = np.lexsort((boff[h], hp))
    h, hp = h[order], hp[order]
    st, so = bst[h].astype(np.int64), boff[h].astype(np.int64)
    starts = np.flatnonzero(np.r_[True, hp[1:] != hp[:-1]]) if len(h) else np.empty(0, np.int64)
    pad = _alignment_pads(so, st, starts)
    so, st = so - pad, st + pad
    excl = np.cumsum(st) - st
    group = np.repeat(starts, np.diff(np.r_[starts, len(h)]))
    local = (PARTITION_DATA_START + excl - excl[group] + pad).astype(np.uint64)
    shares: dict[int, Ranges | None] = {p: None for p, info in enumerate(parts) if info.broadcast}
    for a, z in zip(starts, np.r_[starts[1:], len(h)]):
        shares[int(hp[a])] = np.stack([so[a:z], st[a:z]], axis=1).astype(np.uint64)
    by_id = np.argsort(h, kind="stable")
    dense = DenseMap(_to_array(h[by_id]), _to_array(local[by_id]),
                     frozenset(int(p) for p in hp[starts]))
    del h, hp, order, st, so, pad, excl, group, local, by_id
    trim_heap()  # the sort and cumsum temporaries: ~50 MB of heap at 1.28M blobs otherwise kept
    return shares, dense


def stage_in(
    dest: str,
    local_dir: str,
    manifest: Manifest,
    shares: dict[int, Ranges | None] | None = None,
    workers: int = 4,
    progress: Callable[[int], None] | None = None,
) -> StageResult:
    """Copy partitions into `local_dir`. `shares` maps partition -> ranges (None: whole file);
    absent means every partition whole. Checks free space first; ENOSPC is a clear error."""
    if shares is None:
        shares = {p: None for p in range(len(manifest.partitions))}
    need = sum(
        manifest.partitions[p].size if r is None else int(r[:, 1].sum()) + PARTITION_DATA_START
        for p, r in shares.items()
    )
    os.makedirs(local_dir, exist_ok=True)
    vfs = os.statvfs(local_dir)
    free = vfs.f_bavail * vfs.f_frsize
    if need > free:
        raise FanstoreError(
            f"local directory {local_dir} has {free} bytes free, stage-in needs {need}"
        )

    def one(p: int) -> int:
        info = manifest.partitions[p]
        dst = os.path.join(local_dir, info.name)
        try:
            n = stage_partition(os.path.join(dest, info.name), dst, info.size, shares[p])
        except FileNotFoundError:
            raise FanstoreError(f"partition {info.name} missing from {dest}") from None
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise FanstoreError(f"local directory {local_dir} is full (ENOSPC)") from None
            raise FanstoreError(f"staging {info.name}: {e.strerror}") from None
        with open(dst, "rb") as f:
            check_partition_header(f.read(PARTITION_DATA_START), p, manifest.dataset_id, info.name)
        if progress:
            progress(n)
        return n

    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="stage") as pool:
        total = sum(pool.map(one, sorted(shares)))
    return StageResult(len(shares), total)


def stage_manifest(dest: str, local_dir: str) -> str:
    """Copy DEST's manifest into `local_dir` and return the copy's path: the daemon maps the
    copy, which nobody else can truncate under it."""
    src, dst = os.path.join(dest, MANIFEST_NAME), os.path.join(local_dir, MANIFEST_NAME)
    check_manifest_header(src)  # a header that lies about the size is refused before copying
    try:
        shutil.copyfile(src, dst)
    except (FileNotFoundError, IsADirectoryError):
        raise FormatError(f"no manifest at {src!r}") from None
    except OSError as e:
        code = "ENOSPC" if e.errno == errno.ENOSPC else e.strerror
        raise FanstoreError(f"copying the manifest to {local_dir}: {code}") from None
    return dst
