"""The on-disk format's vocabulary (see docs/format.md): magic numbers and versions, entry kinds,
codec numbers, the manifest's columns and sections and their sane limits, the seeded xxh3
`checksum`, the in-memory `Manifest`, and partition files (header and name).

Pure library code: no FUSE, no MPI. Everything two processes must agree on is
hashed with xxh3-64 and a fixed seed. The manifest file itself is written and read by
`_manifest.py`.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass, field
from typing import Any

import xxhash

from ._errors import FormatError

FORMAT_VERSION = 3  # written by this prep; 3 = 2 + codec 3 (framed blobs)
READ_VERSIONS = (2, 3)  # manifests this build reads (version 2 has no framed blobs)
MANIFEST_MAGIC = b"FSTRMANI"
PARTITION_MAGIC = b"FSTRPART"
MANIFEST_NAME = "manifest.fsm"
HASH_SEED = 0x46414E53  # "FANS": the one seed for every checksum in the format

_PARTITION_HEADER = struct.Struct("<8sHHIQQ")  # magic, version, flags, index, dataset id, reserved
PARTITION_DATA_START = 64  # blobs start here; the header is padded to this size
# Where prep puts a blob of at least ALIGN_MIN stored bytes: its first raw data byte (after a
# raw-framed blob's frame table) on a multiple of DATA_ALIGN in the partition. The dense copy of
# a rank's share keeps such offsets modulo DATA_ALIGN (`_stage.plan_dense`). On AMD EPYC a copy
# whose destination lies 8..24 bytes past its source modulo 4096 runs at a third of the speed
# (`rep movsb`, kernel and glibc alike: `python -m bench.copy_align`); the C readers' buffers
# are 64-aligned too, and two 64-aligned addresses are never that close. Not a format change:
# offsets are in the manifest, as before; older preps read as they did.
DATA_ALIGN = 64
ALIGN_MIN = 4096


def data_lead(codec: int, stored: int, raw: int) -> int:
    """Bytes of a stored blob before its first raw data byte: a raw-framed blob's frame table
    (its frames are stored raw, so the stored bytes exceed the raw ones by exactly the table);
    0 for the others (raw, zstd, zstd-framed: those are decoded anyway)."""
    return stored - raw if codec == CODEC_FRAMED and stored > raw else 0
PARTITION_FLAG_BROADCAST = 1

KIND_FILE, KIND_DIR, KIND_LINK = 0, 1, 2
CODEC_RAW, CODEC_ZSTD, CODEC_ZSTD_DICT, CODEC_FRAMED = 0, 1, 2, 3
CODEC_NAMES = {CODEC_RAW: "raw", CODEC_ZSTD: "zstd", CODEC_ZSTD_DICT: "zstd+dict",
               CODEC_FRAMED: "framed"}
DEFAULT_CHUNK_SIZE = 4 << 20
MAX_CHUNK_SIZE = 64 << 20
# Framed blobs (codec 3): a table of FRAME_HEAD bytes + FRAME_ENTRY per frame, frames of
# MIN_FRAME .. MAX_CHUNK_SIZE raw bytes (`_blobcodec`).
FRAME_HEAD, FRAME_ENTRY = 8, 12
MIN_FRAME = 4096
# Partition files are named part-%05d.fsp / bcast-%05d.fsp (docs/format.md). Anything else could
# collide with the manifest, the local-dir marker or a staging temp file in the node-local dir.
PARTITION_NAME_RE = re.compile(r"(part|bcast)-[0-9]{5,10}\.fsp")

# Entry and blob columns: name -> array typecode (little-endian on disk).
ENTRY_COLUMNS = {
    "parent": "I",  # index of the parent directory (root: 0)
    "kind": "B",  # KIND_*
    "mode": "I",  # st_mode, type bits included, setuid/setgid cleared
    "uid": "I",
    "gid": "I",
    "mtime_ns": "q",
    "size": "Q",  # file: bytes; symlink: length of the target; dir: st_size at prep
    "first": "Q",  # dir: first child entry; file: first blob; symlink: offset in `links`
    "count": "I",  # dir: number of children; file: number of blobs
}
BLOB_COLUMNS = {
    "part": "I",  # partition index
    "offset": "Q",  # byte offset of the stored bytes in the partition file
    "stored": "I",  # stored length
    "raw": "I",  # raw (decoded) length
    "codec": "B",  # CODEC_*
    "xxh3": "Q",  # xxh3-64 (HASH_SEED) of the raw bytes
}
ITEMSIZE = {"B": 1, "I": 4, "q": 8, "Q": 8}
# The sections of a version-2 manifest, in file order.
SECTIONS = (
    "meta", *(f"entries.{k}" for k in ENTRY_COLUMNS), "name_off", "names", "links",
    *(f"blobs.{k}" for k in BLOB_COLUMNS), "zdict",
)
# Sane limits, checked before anything is mapped or allocated.
MAX_ENTRIES = (1 << 32) - 1  # parent indexes are u32
MAX_BLOBS = 1 << 36  # x 64 MiB chunks: sums of sizes stay far below 2**64
MAX_NAME = 255
MAX_LINK = 4096  # PATH_MAX
MAX_META_BYTES = 64 << 20
MAX_ZDICT_BYTES = 16 << 20
MAX_PARTITIONS = 65537

_DIGEST_STEP = 64 << 20  # checksum this much of a mapped file, then drop its pages


def checksum(data: bytes | bytearray | memoryview) -> int:
    """The format's checksum: xxh3-64 with the fixed seed."""
    return xxhash.xxh3_64_intdigest(data, seed=HASH_SEED)



@dataclass
class PartitionInfo:
    name: str
    size: int
    broadcast: bool = False


@dataclass
class Manifest:
    """The whole namespace of a prepped dataset, as columns indexed by entry / blob id.

    Entries are in breadth-first order with each directory's children contiguous and sorted
    by name, so entry 0 is the root and a name lookup is a binary search. Inode = index + 1.
    Columns are any 1-D buffers of the column's type (memoryviews over the mapped file when
    read, `array`s when built by prep); `names` and `links` are byte buffers (slice, then
    `bytes()`).
    """

    dataset_id: int
    options: dict[str, Any]
    partitions: list[PartitionInfo]
    entries: dict[str, Any]
    name_off: Any  # n + 1 offsets into `names`
    names: Any
    links: Any
    blobs: dict[str, Any]
    zdict: bytes = b""
    version: int = FORMAT_VERSION  # read: the file's; built: what write_manifest writes
    _checked: bool = field(default=False, repr=False)
    _keep: Any = field(default=None, repr=False)  # the mapping the columns view
    _total: int | None = field(default=None, repr=False)

    @property
    def n_entries(self) -> int:
        return len(self.entries["parent"])

    def drop_pages(self, step: int = 64 << 20) -> None:
        """Unmap the pages of the mapped manifest this process touched (`MADV_DONTNEED`, in
        `step`-byte calls): they stay in the page cache and the next touch is a minor fault,
        so a walk over every entry does not keep the whole manifest resident. No-op for a
        manifest built in memory."""
        mm = self._keep
        if not isinstance(mm, mmap.mmap):
            return
        for a in range(0, len(mm), step):
            mm.madvise(mmap.MADV_DONTNEED, a, min(step, len(mm) - a))

    @property
    def n_blobs(self) -> int:
        return len(self.blobs["part"])

    def name(self, i: int) -> bytes:
        return bytes(self.names[self.name_off[i] : self.name_off[i + 1]])

    def path(self, i: int) -> bytes:
        parts = []
        parent = self.entries["parent"]
        while i != 0:
            parts.append(self.name(i))
            i = parent[i]
        return b"/".join(reversed(parts))

    def link(self, i: int) -> bytes:
        o = self.entries["first"][i]
        return bytes(self.links[o : o + self.entries["size"][i]])

    def total_bytes(self) -> int:
        if self._total is None:
            import numpy as np

            raw = np.frombuffer(self.blobs["raw"], dtype="<u4")
            self._total = int(raw.sum(dtype=np.uint64))
        return self._total


# ---------------------------------------------------------------- partitions


def partition_header(
    index: int, dataset_id: int, broadcast: bool, version: int = FORMAT_VERSION
) -> bytes:
    flags = PARTITION_FLAG_BROADCAST if broadcast else 0
    h = _PARTITION_HEADER.pack(PARTITION_MAGIC, version, flags, index, dataset_id, 0)
    return h.ljust(PARTITION_DATA_START, b"\0")


def check_partition_header(data: bytes, index: int, dataset_id: int, name: str) -> None:
    if len(data) < _PARTITION_HEADER.size:
        raise FormatError(f"partition {name} is truncated (no header)")
    magic, version, _flags, idx, ds, _ = _PARTITION_HEADER.unpack_from(data)
    if magic != PARTITION_MAGIC:
        raise FormatError(f"partition {name}: bad magic")
    if version not in READ_VERSIONS:  # the dataset id ties it to its manifest's version
        raise FormatError(f"partition {name}: format version {version} unsupported")
    if idx != index or ds != dataset_id:
        raise FormatError(f"partition {name} belongs to another dataset or slot")


def partition_name(index: int, broadcast: bool = False) -> str:
    return f"bcast-{index:05d}.fsp" if broadcast else f"part-{index:05d}.fsp"
