"""`prep`: walk a source tree and pack it into partitions plus a manifest.

Deterministic: the same tree and options always give the same bytes (entries are
sorted, blob order is fixed, zstd is single-threaded per blob).
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
import stat
import threading
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import xxhash
import zstandard

from ._errors import FanstoreError
from ._format import (
    BLOB_COLUMNS,
    CODEC_RAW,
    CODEC_ZSTD,
    DEFAULT_CHUNK_SIZE,
    ENTRY_COLUMNS,
    HASH_SEED,
    KIND_DIR,
    KIND_FILE,
    KIND_LINK,
    MANIFEST_NAME,
    MAX_CHUNK_SIZE,
    PARTITION_DATA_START,
    Manifest,
    PartitionInfo,
    checksum,
    partition_header,
    partition_name,
    write_manifest,
)
from ._perms import keep_source_access

log = logging.getLogger("fanstore_fuse.prep")
J = TypeVar("J")
R = TypeVar("R")
_DROP_BITS = stat.S_ISUID | stat.S_ISGID
_PARTITION_FILE = re.compile(r"(part|bcast)-\d{5}\.fsp")
PROBE_MIN = 32 << 10  # chunks at least this big are probed before being compressed whole
PROBE_RATIO = 0.97  # samples that do not shrink below this fraction mark a chunk incompressible


@dataclass
class PrepOptions:
    partitions: int = 4
    codec: str = "zstd"
    level: int = 3
    chunk_size: int = DEFAULT_CHUNK_SIZE
    broadcast: list[str] = field(default_factory=list)
    workers: int = 0  # 0: one per CPU
    mode: int | None = None  # DEST's file mode; None: the source's access (see _perms)
    group: str | None = None  # DEST's group (name or gid)

    def check(self) -> None:
        if self.partitions < 1 or self.partitions > 65536:
            raise FanstoreError(f"--partitions must be in 1..65536, got {self.partitions}")
        if self.codec not in ("zstd", "none"):
            raise FanstoreError(f"--codec must be zstd or none, got {self.codec!r}")
        if not -7 <= self.level <= 22:
            raise FanstoreError(f"--level must be in -7..22, got {self.level}")
        if not 4096 <= self.chunk_size <= MAX_CHUNK_SIZE:
            raise FanstoreError(f"chunk size must be in 4096..{MAX_CHUNK_SIZE}")


@dataclass
class PrepResult:
    manifest: Manifest
    files: int
    dirs: int
    symlinks: int
    skipped: int
    raw_bytes: int
    stored_bytes: int


@dataclass
class _Entry:
    src: bytes
    name: bytes
    parent: int
    kind: int
    st: os.stat_result
    link: bytes = b""
    first: int = 0
    count: int = 0


def _walk(src: bytes, exclude: tuple[int, int] | None = None) -> tuple[list[_Entry], int]:
    """Breadth-first walk; each directory's children sorted by name and contiguous.
    `exclude` is the (st_dev, st_ino) of a directory to leave out (DEST inside SRC)."""
    st = os.lstat(src)
    if not stat.S_ISDIR(st.st_mode):
        raise FanstoreError(f"source {os.fsdecode(src)!r} is not a directory")
    out = [_Entry(src, b"", 0, KIND_DIR, st)]
    skipped = 0
    i = 0
    while i < len(out):
        e = out[i]
        if e.kind == KIND_DIR:
            kids: list[_Entry] = []
            with os.scandir(e.src) as it:
                for de in it:
                    cst = de.stat(follow_symlinks=False)
                    m = cst.st_mode
                    if stat.S_ISDIR(m):
                        if exclude == (cst.st_dev, cst.st_ino):
                            log.warning("leaving out %s: it is the output directory",
                                        os.fsdecode(de.path))
                            continue
                        kids.append(_Entry(de.path, de.name, i, KIND_DIR, cst))
                    elif stat.S_ISREG(m):
                        kids.append(_Entry(de.path, de.name, i, KIND_FILE, cst))
                    elif stat.S_ISLNK(m):
                        kids.append(_Entry(de.path, de.name, i, KIND_LINK, cst, os.readlink(de.path)))
                    else:
                        skipped += 1
                        log.warning("skipping special file %s", os.fsdecode(de.path))
            kids.sort(key=lambda k: k.name)
            e.first, e.count = len(out), len(kids)
            out.extend(kids)
        i += 1
    return out, skipped


def _rel_paths(entries: list[_Entry]) -> list[bytes]:
    rel = [b""] * len(entries)
    for i in range(1, len(entries)):
        p = rel[entries[i].parent]
        rel[i] = p + b"/" + entries[i].name if p else entries[i].name
    return rel


def _is_broadcast(rel: bytes, globs: list[str]) -> bool:
    if not globs:
        return False
    s = os.fsdecode(rel)
    parts = s.split("/")
    prefixes = ["/".join(parts[: k + 1]) for k in range(len(parts))]
    return any(fnmatch.fnmatchcase(p, g) for g in globs for p in prefixes)


@dataclass
class _BlobJob:
    src: bytes
    offset: int
    length: int
    part: int


class _Packer:
    """Reads, checksums and compresses one chunk per call; safe to call from many threads."""

    def __init__(self, codec: str, level: int):
        self.codec = codec
        self.level = level
        self._local = threading.local()

    def __call__(self, job: _BlobJob) -> tuple[bytes, int, int, int]:
        fd = os.open(job.src, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            raw = os.pread(fd, job.length, job.offset)
        finally:
            os.close(fd)
        if len(raw) != job.length:
            raise FanstoreError(f"{os.fsdecode(job.src)} changed size during prep")
        digest = checksum(raw)
        if self.codec == "zstd" and raw:
            c = getattr(self._local, "c", None)
            if c is None:
                c = self._local.c = zstandard.ZstdCompressor(
                    level=self.level, write_content_size=True, write_checksum=False
                )
            if not self._looks_incompressible(c, raw):
                packed = c.compress(raw)
                if len(packed) < len(raw):
                    return packed, CODEC_ZSTD, len(raw), digest
        return raw, CODEC_RAW, len(raw), digest

    @staticmethod
    def _looks_incompressible(c: zstandard.ZstdCompressor, raw: bytes) -> bool:
        """Compress three 4 KiB samples (start, middle, end) first: JPEG-like data that does not
        shrink there is stored raw without compressing it all (most of an image dataset)."""
        if len(raw) < PROBE_MIN:
            return False
        mid = len(raw) // 2
        sample = raw[:4096] + raw[mid : mid + 4096] + raw[-4096:]
        return len(c.compress(sample)) >= PROBE_RATIO * len(sample)


def ordered_map(
    pool: ThreadPoolExecutor, fn: Callable[[J], R], jobs: Iterable[J], window: int
) -> Iterator[R]:
    """Like pool.map but lazy in `jobs` and with at most `window` results in memory."""
    pending: deque[Future[R]] = deque()
    it = iter(jobs)
    for job in it:
        pending.append(pool.submit(fn, job))
        if len(pending) >= window:
            break
    while pending:
        yield pending.popleft().result()
        nxt = next(it, None)
        if nxt is not None:
            pending.append(pool.submit(fn, nxt))


@keep_source_access
def prep(
    src: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    options: PrepOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> PrepResult:
    """Pack the tree at `src` into `dest`. `progress(files_done, bytes_done)` is called often."""
    opts = options or PrepOptions()
    opts.check()
    src_b = os.fsencode(os.path.abspath(src))
    dest_s = os.fspath(dest)
    os.makedirs(dest_s, exist_ok=True)
    dst = os.stat(dest_s)
    entries, skipped = _walk(src_b, exclude=(dst.st_dev, dst.st_ino))
    rel = _rel_paths(entries)
    n = len(entries)

    # Dataset identity: a stable hash of the listing and the options that shape the output.
    h = xxhash.xxh3_64(seed=HASH_SEED)
    h.update(repr((opts.partitions, opts.codec, opts.level, opts.chunk_size, opts.broadcast)).encode())
    for e, r in zip(entries, rel):
        h.update(r + b"\0" + repr((e.kind, e.st.st_size, e.st.st_mtime_ns, e.st.st_mode)).encode())
    dataset_id = h.intdigest()

    # Partition plan: regular files cut into contiguous partitions by bytes; broadcast files last.
    files = [i for i in range(n) if entries[i].kind == KIND_FILE]
    bcast = {i for i in files if _is_broadcast(rel[i], opts.broadcast)}
    normal_total = sum(entries[i].st.st_size for i in files if i not in bcast)
    nparts = opts.partitions
    target = max(1, -(-normal_total // nparts))
    part_of: dict[int, int] = {}
    acc = 0
    for i in files:
        if i in bcast:
            part_of[i] = nparts
        else:
            part_of[i] = min(nparts - 1, acc // target)
            acc += entries[i].st.st_size
    has_bcast = bool(bcast)
    part_names = [partition_name(p) for p in range(nparts)]
    if has_bcast:
        part_names.append(partition_name(nparts, broadcast=True))

    # Blob ids follow entry order, so a file's blobs are contiguous.
    jobs: list[_BlobJob] = []
    for i in files:
        e = entries[i]
        e.first = len(jobs)
        size = e.st.st_size
        for off in range(0, size, opts.chunk_size):
            jobs.append(_BlobJob(e.src, off, min(opts.chunk_size, size - off), part_of[i]))
        e.count = len(jobs) - e.first
    write_order = sorted(range(len(jobs)), key=lambda j: jobs[j].part)  # stable: id order

    nb = len(jobs)
    b_cols = {k: array(t, bytes(array(t).itemsize * nb)) for k, t in BLOB_COLUMNS.items()}
    part_sizes = [PARTITION_DATA_START] * len(part_names)
    tmp_names = [os.path.join(dest_s, nm + ".tmp") for nm in part_names]
    handles = [open(p, "wb") for p in tmp_names]
    workers = opts.workers or (os.cpu_count() or 1)
    packer = _Packer(opts.codec, opts.level)
    files_done = bytes_done = stored_total = 0
    blob_file = {}
    for i in files:
        for j in range(entries[i].first, entries[i].first + entries[i].count):
            blob_file[j] = i
    try:
        for p, f in enumerate(handles):
            f.write(partition_header(p, dataset_id, has_bcast and p == nparts))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="prep") as pool:
            ordered = [jobs[j] for j in write_order]
            for j, (data, codec, raw_len, digest) in zip(
                write_order, ordered_map(pool, packer, ordered, window=workers * 8)
            ):
                p = jobs[j].part
                b_cols["part"][j] = p
                b_cols["offset"][j] = part_sizes[p]
                b_cols["stored"][j] = len(data)
                b_cols["raw"][j] = raw_len
                b_cols["codec"][j] = codec
                b_cols["xxh3"][j] = digest
                handles[p].write(data)
                part_sizes[p] += len(data)
                stored_total += len(data)
                bytes_done += raw_len
                fi = blob_file[j]
                if j == entries[fi].first + entries[fi].count - 1:
                    files_done += 1
                if progress:
                    progress(files_done, bytes_done)
        for f in handles:
            f.flush()
            os.fsync(f.fileno())
    finally:
        for f in handles:
            f.close()
    for tmp, nm in zip(tmp_names, part_names):
        os.replace(tmp, os.path.join(dest_s, nm))
    for old in os.listdir(dest_s):  # partitions of an earlier prep into the same DEST
        if _PARTITION_FILE.fullmatch(old) and old not in part_names:
            os.unlink(os.path.join(dest_s, old))
    # Files with no blobs (empty) count as done too.
    if progress:
        progress(len(files), bytes_done)

    cols = {k: array(t) for k, t in ENTRY_COLUMNS.items()}
    name_off = array("Q", [0])
    names = bytearray()
    links = bytearray()
    for e in entries:
        st = e.st
        cols["parent"].append(e.parent)
        cols["kind"].append(e.kind)
        cols["mode"].append(st.st_mode & ~_DROP_BITS)
        cols["uid"].append(st.st_uid)
        cols["gid"].append(st.st_gid)
        cols["mtime_ns"].append(st.st_mtime_ns)
        if e.kind == KIND_LINK:
            cols["size"].append(len(e.link))
            cols["first"].append(len(links))
            cols["count"].append(0)
            links += e.link
        else:
            cols["size"].append(st.st_size)
            cols["first"].append(e.first)
            cols["count"].append(e.count)
        names += e.name
        name_off.append(len(names))
    manifest = Manifest(
        dataset_id=dataset_id,
        options={
            "codec": opts.codec,
            "level": opts.level,
            "chunk_size": opts.chunk_size,
            "partitions": nparts,
            "broadcast": list(opts.broadcast),
        },
        partitions=[
            PartitionInfo(nm, sz, has_bcast and p == nparts)
            for p, (nm, sz) in enumerate(zip(part_names, part_sizes))
        ],
        entries=cols,
        name_off=name_off,
        names=bytes(names),
        links=bytes(links),
        blobs=b_cols,
    )
    write_manifest(os.path.join(dest_s, MANIFEST_NAME), manifest)
    kinds = cols["kind"]
    return PrepResult(
        manifest=manifest,
        files=len(files),
        dirs=sum(1 for k in kinds if k == KIND_DIR),
        symlinks=sum(1 for k in kinds if k == KIND_LINK),
        skipped=skipped,
        raw_bytes=bytes_done,
        stored_bytes=stored_total,
    )
