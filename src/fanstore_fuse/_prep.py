"""`prep`: walk a source tree and pack it into partitions plus a manifest.

Deterministic: the same tree and options always give the same bytes (entries are
sorted, blob order is fixed, zstd is single-threaded per blob).
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import threading
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import zstandard

from . import _blobcodec, _zdict
from ._blobcodec import DEFAULT_FRAME_SIZE, MIN_FRAME, RAW_FRAME_SIZE
from ._errors import FanstoreError
from ._format import (
    ALIGN_MIN,
    BLOB_COLUMNS,
    CODEC_FRAMED,
    CODEC_RAW,
    CODEC_ZSTD,
    CODEC_ZSTD_DICT,
    DATA_ALIGN,
    DEFAULT_CHUNK_SIZE,
    KIND_DIR,
    KIND_FILE,
    KIND_LINK,
    MANIFEST_NAME,
    MAX_CHUNK_SIZE,
    PARTITION_DATA_START,
    Manifest,
    PartitionInfo,
    checksum,
    data_lead,
    partition_header,
    partition_name,
)
from ._manifest import write_manifest
from ._perms import keep_source_access
from ._walk import Listing, walk

log = logging.getLogger("fanstore_fuse.prep")
J = TypeVar("J")
R = TypeVar("R")
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
    frame_size: int = DEFAULT_FRAME_SIZE  # chunks over 2 frames are framed (codec 3); 0: never
    dictionary: str = "off"  # "auto": train a zstd dictionary for small files (codec 2)

    def check(self) -> None:
        if self.partitions < 1 or self.partitions > 65536:
            raise FanstoreError(f"--partitions must be in 1..65536, got {self.partitions}")
        if self.codec not in ("zstd", "none"):
            raise FanstoreError(f"--codec must be zstd or none, got {self.codec!r}")
        if not -7 <= self.level <= 22:
            raise FanstoreError(f"--level must be in -7..22, got {self.level}")
        if not 4096 <= self.chunk_size <= MAX_CHUNK_SIZE:
            raise FanstoreError(f"chunk size must be in 4096..{MAX_CHUNK_SIZE}")
        if self.dictionary not in ("auto", "off"):
            raise FanstoreError(f"--dict must be auto or off, got {self.dictionary!r}")
        if self.frame_size and not MIN_FRAME <= self.frame_size <= MAX_CHUNK_SIZE:
            raise FanstoreError(f"frame size must be 0 or in {MIN_FRAME}..{MAX_CHUNK_SIZE}")


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
class _BlobJob:
    src: bytes
    offset: int
    length: int
    part: int
    blob: int
    last: bool  # the file's last blob


class _Packer:
    """Reads, checksums and compresses one chunk per call; safe to call from many threads."""

    def __init__(self, codec: str, level: int, frame_size: int = 0, zdict: bytes = b""):
        self.codec = codec
        self.level = level
        self.frame_size = frame_size
        self.zdict = zstandard.ZstdCompressionDict(zdict) if zdict else None
        self._local = threading.local()

    def __call__(self, job: _BlobJob) -> tuple[bytes, int, int, int]:
        fd = os.open(job.src, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            raw = os.pread(fd, job.length, job.offset)
        finally:
            os.close(fd)
        if len(raw) != job.length:
            raise FanstoreError(f"{os.fsdecode(job.src)} changed size during prep")
        c = self._compressor() if self.codec == "zstd" and raw else None
        if c is not None and self._looks_incompressible(c, raw):
            c = None
        if self.frame_size and len(raw) > 2 * self.frame_size:
            return self._framed(raw, c)
        digest = checksum(raw)
        if c is not None:
            packed, codec = c.compress(raw), CODEC_ZSTD
            if self.zdict is not None and len(raw) <= _zdict.SMALL:
                with_dict = self._dict_compressor().compress(raw)
                if len(with_dict) < len(packed):
                    packed, codec = with_dict, CODEC_ZSTD_DICT
            if len(packed) < len(raw):
                return packed, codec, len(raw), digest
        return raw, CODEC_RAW, len(raw), digest

    def _dict_compressor(self) -> zstandard.ZstdCompressor:
        c = getattr(self._local, "cd", None)
        if c is None:
            c = self._local.cd = zstandard.ZstdCompressor(
                level=self.level, dict_data=self.zdict, write_content_size=True,
                write_checksum=False,
            )
        return c

    def _compressor(self) -> zstandard.ZstdCompressor:
        c = getattr(self._local, "c", None)
        if c is None:
            c = self._local.c = zstandard.ZstdCompressor(
                level=self.level, write_content_size=True, write_checksum=False
            )
        return c

    def _framed(self, raw: bytes, c: zstandard.ZstdCompressor | None) -> tuple[bytes, int, int, int]:
        """A large chunk as a seekable blob: zstd frames of `frame_size`, or (nothing shrank)
        raw sub-blocks of RAW_FRAME_SIZE, each with its own checksum."""
        if c is not None:
            stored, digest = _blobcodec.encode(raw, self.frame_size, c.compress)
            if len(stored) < len(raw):
                return stored, CODEC_FRAMED, len(raw), digest
        stored, digest = _blobcodec.encode(raw, min(RAW_FRAME_SIZE, self.frame_size), None)
        return stored, CODEC_FRAMED, len(raw), digest

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


def _jobs(w: Listing, nparts: int, broadcast: bool) -> Iterator[_BlobJob]:
    """Blob jobs in write order, lazily: normal files cut into `nparts` contiguous runs by
    bytes (entry order), or (broadcast=True) the broadcast files, all in partition `nparts`."""
    kind, size, first = w.cols["kind"], w.cols["size"], w.cols["first"]
    target = max(1, -(-w.normal_bytes // nparts))
    chunk = w.chunk
    acc = 0
    for i in range(len(w)):
        if kind[i] != KIND_FILE or bool(w.bcast[i]) != broadcast:
            continue
        n = size[i]
        if broadcast:
            p = nparts
        else:
            p = min(nparts - 1, acc // target)
            acc += n
        if not n:
            continue
        src, b = w.source(i), first[i]
        for k, off in enumerate(range(0, n, chunk)):
            yield _BlobJob(src, off, min(chunk, n - off), p, b + k, off + chunk >= n)


@keep_source_access
def prep(
    src: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    options: PrepOptions | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> PrepResult:
    """Pack the tree at `src` into `dest`. `progress(files_done, bytes_done)` is called often.
    Memory: compact columns (~45 bytes + the name per entry) and a bounded window of chunks."""
    opts = options or PrepOptions()
    opts.check()
    src_b = os.fsencode(os.path.abspath(src))
    dest_s = os.fspath(dest)
    os.makedirs(dest_s, exist_ok=True)
    dst = os.stat(dest_s)
    # Dataset identity: a stable hash of the options that shape the output and the listing.
    shape = (opts.partitions, opts.codec, opts.level, opts.chunk_size, opts.broadcast)
    extra = ((opts.frame_size,) if opts.frame_size else ()) + (
        ("dict",) if opts.dictionary == "auto" else ())
    salt = repr(shape + extra).encode()
    w = walk(src_b, opts.chunk_size, opts.broadcast, exclude=(dst.st_dev, dst.st_ino), salt=salt)
    dataset_id = w.hasher.intdigest()
    kinds = w.cols["kind"]
    n_files = sum(1 for k in kinds if k == KIND_FILE)
    nparts = opts.partitions
    has_bcast = any(w.bcast)
    part_names = [partition_name(p) for p in range(nparts)]
    if has_bcast:
        part_names.append(partition_name(nparts, broadcast=True))

    nb = w.n_blobs
    b_cols = {k: array(t, bytes(array(t).itemsize * nb)) for k, t in BLOB_COLUMNS.items()}
    part_sizes = [PARTITION_DATA_START] * len(part_names)
    tmp_names = [os.path.join(dest_s, nm + ".tmp") for nm in part_names]
    handles = [open(p, "wb") for p in tmp_names]
    workers = opts.workers or (os.cpu_count() or 1)
    zdict = _zdict.train(w, opts.level) if opts.dictionary == "auto" and opts.codec == "zstd" else b""
    packer = _Packer(opts.codec, opts.level, opts.frame_size, zdict)
    files_done = bytes_done = stored_total = 0
    jobs = _jobs(w, nparts, False)
    if has_bcast:
        jobs = itertools.chain(jobs, _jobs(w, nparts, True))
    try:
        for p, f in enumerate(handles):
            f.write(partition_header(p, dataset_id, has_bcast and p == nparts))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="prep") as pool:
            for job, (data, codec, raw_len, digest) in ordered_map(
                pool, lambda j: (j, packer(j)), jobs, window=workers * 8
            ):
                p, j = job.part, job.blob
                if len(data) >= ALIGN_MIN:  # its raw data on a DATA_ALIGN boundary
                    pad = -(part_sizes[p] + data_lead(codec, len(data), raw_len)) % DATA_ALIGN
                    handles[p].write(bytes(pad))
                    part_sizes[p] += pad
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
                files_done += job.last
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
        progress(n_files, bytes_done)

    if zdict and CODEC_ZSTD_DICT not in b_cols["codec"]:
        zdict = b""  # no blob gained from it
    manifest = Manifest(
        dataset_id=dataset_id,
        options={
            "codec": opts.codec,
            "level": opts.level,
            "chunk_size": opts.chunk_size,
            "partitions": nparts,
            "broadcast": list(opts.broadcast),
            "frame_size": opts.frame_size,
            "dict": opts.dictionary,
        },
        partitions=[
            PartitionInfo(nm, sz, has_bcast and p == nparts)
            for p, (nm, sz) in enumerate(zip(part_names, part_sizes))
        ],
        entries=w.cols,
        name_off=w.name_off,
        names=w.names,
        links=w.links,
        blobs=b_cols,
        zdict=zdict,
    )
    write_manifest(os.path.join(dest_s, MANIFEST_NAME), manifest)
    return PrepResult(
        manifest=manifest,
        files=n_files,
        dirs=sum(1 for k in kinds if k == KIND_DIR),
        symlinks=sum(1 for k in kinds if k == KIND_LINK),
        skipped=w.skipped,
        raw_bytes=bytes_done,
        stored_bytes=stored_total,
    )
