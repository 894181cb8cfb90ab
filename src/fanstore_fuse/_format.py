"""The on-disk format: manifest and partition files (see docs/format.md).

Pure library code: no FUSE, no MPI. Everything two processes must agree on is
hashed with xxh3-64 and a fixed seed.
"""

from __future__ import annotations

import os
import re
import stat
import struct
import sys
from array import array
from dataclasses import dataclass, field
from typing import Any

import msgpack
import xxhash
import zstandard

from ._errors import ChecksumError, FormatError

FORMAT_VERSION = 1
MANIFEST_MAGIC = b"FSTRMANI"
PARTITION_MAGIC = b"FSTRPART"
MANIFEST_NAME = "manifest.fsm"
HASH_SEED = 0x46414E53  # "FANS": the one seed for every checksum in the format

_MANIFEST_HEADER = struct.Struct("<8sHHIQQ")  # magic, version, flags, reserved, len, xxh3
_PARTITION_HEADER = struct.Struct("<8sHHIQQ")  # magic, version, flags, index, dataset id, reserved
PARTITION_DATA_START = 64  # blobs start here; the header is padded to this size
MANIFEST_FLAG_ZSTD = 1
PARTITION_FLAG_BROADCAST = 1
MAX_MANIFEST_BYTES = 1 << 34

KIND_FILE, KIND_DIR, KIND_LINK = 0, 1, 2
CODEC_RAW, CODEC_ZSTD, CODEC_ZSTD_DICT = 0, 1, 2
CODEC_NAMES = {CODEC_RAW: "raw", CODEC_ZSTD: "zstd", CODEC_ZSTD_DICT: "zstd+dict"}
DEFAULT_CHUNK_SIZE = 4 << 20
MAX_CHUNK_SIZE = 64 << 20
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


def checksum(data: bytes | memoryview) -> int:
    """The format's checksum: xxh3-64 with the fixed seed."""
    return xxhash.xxh3_64_intdigest(data, seed=HASH_SEED)


def _to_le(col: array) -> bytes:
    if sys.byteorder == "big":  # pragma: no cover - all targets are little-endian
        col = array(col.typecode, col)
        col.byteswap()
    return col.tobytes()


def _from_le(typecode: str, data: Any, n: int, what: str) -> array:
    if not isinstance(data, bytes):
        raise FormatError(f"manifest column {what!r} is not binary")
    col = array(typecode)
    if len(data) != n * col.itemsize:
        raise FormatError(f"manifest column {what!r} has {len(data)} bytes, expected {n * col.itemsize}")
    col.frombytes(data)
    if sys.byteorder == "big":  # pragma: no cover
        col.byteswap()
    return col


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
    """

    dataset_id: int
    options: dict[str, Any]
    partitions: list[PartitionInfo]
    entries: dict[str, array]
    name_off: array  # n + 1 offsets into `names`
    names: bytes
    links: bytes
    blobs: dict[str, array]
    zdict: bytes = b""
    _checked: bool = field(default=False, repr=False)

    @property
    def n_entries(self) -> int:
        return len(self.entries["parent"])

    @property
    def n_blobs(self) -> int:
        return len(self.blobs["part"])

    def name(self, i: int) -> bytes:
        return self.names[self.name_off[i] : self.name_off[i + 1]]

    def path(self, i: int) -> bytes:
        parts = []
        parent = self.entries["parent"]
        while i != 0:
            parts.append(self.name(i))
            i = parent[i]
        return b"/".join(reversed(parts))

    def total_bytes(self) -> int:
        return sum(self.blobs["raw"])


# ---------------------------------------------------------------- manifest codec


def encode_manifest(m: Manifest, compress: bool = True) -> bytes:
    payload = msgpack.packb(
        {
            "format": FORMAT_VERSION,
            "dataset_id": m.dataset_id,
            "options": m.options,
            "partitions": [[p.name, p.size, p.broadcast] for p in m.partitions],
            "n_entries": m.n_entries,
            "entries": {k: _to_le(m.entries[k]) for k in ENTRY_COLUMNS},
            "name_off": _to_le(m.name_off),
            "names": m.names,
            "links": m.links,
            "n_blobs": m.n_blobs,
            "blobs": {k: _to_le(m.blobs[k]) for k in BLOB_COLUMNS},
            "zdict": m.zdict,
        },
        use_bin_type=True,
    )
    flags = 0
    if compress:
        payload = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(payload)
        flags |= MANIFEST_FLAG_ZSTD
    header = _MANIFEST_HEADER.pack(
        MANIFEST_MAGIC, FORMAT_VERSION, flags, 0, len(payload), checksum(payload)
    )
    return header + payload


def decode_manifest(data: bytes) -> Manifest:
    """Parse and fully validate a manifest; raise FormatError with a clear message."""
    if len(data) < _MANIFEST_HEADER.size:
        raise FormatError("manifest is truncated (no header)")
    magic, version, flags, reserved, length, digest = _MANIFEST_HEADER.unpack_from(data)
    if magic != MANIFEST_MAGIC:
        raise FormatError("not a fanstore-fuse manifest (bad magic)")
    if version != FORMAT_VERSION:
        raise FormatError(f"manifest format version {version}, this build reads {FORMAT_VERSION}")
    # The header is not covered by the checksum: refuse any bit this version does not define.
    if flags & ~MANIFEST_FLAG_ZSTD or reserved:
        raise FormatError(f"manifest header has unknown flags {flags:#x} or reserved {reserved:#x}")
    payload = data[_MANIFEST_HEADER.size :]
    if len(payload) != length:
        raise FormatError(f"manifest payload is {len(payload)} bytes, header says {length}")
    if checksum(payload) != digest:
        raise FormatError("manifest checksum mismatch (corrupt manifest)")
    if flags & MANIFEST_FLAG_ZSTD:
        try:
            payload = zstandard.ZstdDecompressor().decompress(
                payload, max_output_size=MAX_MANIFEST_BYTES
            )
        except zstandard.ZstdError as e:
            raise FormatError(f"manifest does not decompress: {e}") from None
    try:
        d = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types on garbage
        raise FormatError(f"manifest payload is not valid msgpack: {e}") from None
    try:
        return _manifest_from_dict(d)
    except FormatError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise FormatError(f"manifest is malformed: {type(e).__name__}: {e}") from None


def _manifest_from_dict(d: dict[str, Any]) -> Manifest:
    if d.get("format") != FORMAT_VERSION:
        raise FormatError(f"manifest payload format {d.get('format')!r} unsupported")
    n = int(d["n_entries"])
    nb = int(d["n_blobs"])
    if n < 1 or n > 1 << 32 or nb < 0 or nb > 1 << 40:
        raise FormatError(f"manifest counts out of range: {n} entries, {nb} blobs")
    entries = {k: _from_le(t, d["entries"][k], n, k) for k, t in ENTRY_COLUMNS.items()}
    blobs = {k: _from_le(t, d["blobs"][k], nb, k) for k, t in BLOB_COLUMNS.items()}
    name_off = _from_le("Q", d["name_off"], n + 1, "name_off")
    parts = [PartitionInfo(str(p[0]), int(p[1]), bool(p[2])) for p in d["partitions"]]
    names, links, zdict = d["names"], d["links"], d.get("zdict") or b""
    if not all(isinstance(x, bytes) for x in (names, links, zdict)):
        raise FormatError("manifest names/links/dictionary are not binary")
    m = Manifest(
        dataset_id=int(d["dataset_id"]),
        options=dict(d["options"]),
        partitions=parts,
        entries=entries,
        name_off=name_off,
        names=names,
        links=links,
        blobs=blobs,
        zdict=zdict,
    )
    validate_manifest(m)
    return m


def validate_manifest(m: Manifest) -> None:
    """Refuse anything a hostile or corrupt manifest could use to escape or confuse us."""
    e, b = m.entries, m.blobs
    n, nb = m.n_entries, m.n_blobs
    parent, kind, mode, size, first, count = (
        e["parent"], e["kind"], e["mode"], e["size"], e["first"], e["count"],
    )
    off = m.name_off
    if off[0] != 0 or off[n] != len(m.names):
        raise FormatError("manifest name table is inconsistent")
    if any(off[i] > off[i + 1] for i in range(n)):
        raise FormatError("manifest name table is inconsistent (offsets decrease)")
    for i, p in enumerate(m.partitions):
        if not PARTITION_NAME_RE.fullmatch(p.name):
            raise FormatError(f"partition {i} has an unsafe file name {p.name!r}")
        if p.size < PARTITION_DATA_START:
            raise FormatError(f"partition {i} size {p.size} is too small")
    if len({p.name for p in m.partitions}) != len(m.partitions):
        raise FormatError("duplicate partition names")
    if kind[0] != KIND_DIR or parent[0] != 0 or off[1] != 0:
        raise FormatError("entry 0 is not the root directory")
    chunk = int(m.options.get("chunk_size", DEFAULT_CHUNK_SIZE))
    if not 4096 <= chunk <= MAX_CHUNK_SIZE:
        raise FormatError(f"chunk size {chunk} out of range")
    children_total = 0
    raw = b["raw"]
    raw_before = array("Q", [0])  # prefix sums: a file's size check is O(1), not O(its blobs)
    for j in range(nb):
        raw_before.append(raw_before[-1] + raw[j])
    for i in range(n):
        k = kind[i]
        md = mode[i]
        if md & (stat.S_ISUID | stat.S_ISGID):
            raise FormatError(f"entry {i} has setuid/setgid bits")
        if k == KIND_DIR:
            if not stat.S_ISDIR(md):
                raise FormatError(f"entry {i}: kind/mode mismatch")
            c0, cn = first[i], count[i]
            if cn and (c0 <= i or c0 + cn > n):
                raise FormatError(f"directory entry {i} has children out of range (cycle?)")
            children_total += cn
            prev = None
            for j in range(c0, c0 + cn):
                if parent[j] != i:
                    raise FormatError(f"entry {j} is listed in directory {i} but names another parent")
                nm = m.names[off[j] : off[j + 1]]
                if prev is not None and nm <= prev:
                    raise FormatError(f"directory {i} has unsorted or duplicate names ({nm!r})")
                prev = nm
        elif k == KIND_FILE:
            if not stat.S_ISREG(md):
                raise FormatError(f"entry {i}: kind/mode mismatch")
            b0, bn = first[i], count[i]
            if b0 + bn > nb:
                raise FormatError(f"file entry {i} names blobs beyond the blob table")
            if raw_before[b0 + bn] - raw_before[b0] != size[i]:
                raise FormatError(f"file entry {i}: size {size[i]} does not match its blobs")
        elif k == KIND_LINK:
            if not stat.S_ISLNK(md):
                raise FormatError(f"entry {i}: kind/mode mismatch")
            if first[i] + size[i] > len(m.links) or size[i] == 0:
                raise FormatError(f"symlink entry {i} target out of range")
            if b"\0" in m.links[first[i] : first[i] + size[i]]:
                raise FormatError(f"symlink entry {i} target contains NUL")
        else:
            raise FormatError(f"entry {i} has unknown kind {k}")
        if i:
            if parent[i] >= i or kind[parent[i]] != KIND_DIR:
                raise FormatError(f"entry {i} has a bad parent (cycle or non-directory)")
            nm = m.names[off[i] : off[i + 1]]
            if not nm or nm in (b".", b"..") or b"/" in nm or b"\0" in nm or len(nm) > 255:
                raise FormatError(f"entry {i} has an unsafe name {nm!r}")
    if children_total != n - 1:
        raise FormatError("directory listings do not cover every entry exactly once")
    nparts = len(m.partitions)
    bpart, boff, bst, braw, bcod = b["part"], b["offset"], b["stored"], b["raw"], b["codec"]
    for j in range(nb):
        p = bpart[j]
        if p >= nparts:
            raise FormatError(f"blob {j} names partition {p} of {nparts}")
        if boff[j] < PARTITION_DATA_START or boff[j] + bst[j] > m.partitions[p].size:
            raise FormatError(f"blob {j} lies outside partition {m.partitions[p].name}")
        if braw[j] > chunk:
            raise FormatError(f"blob {j} raw size {braw[j]} exceeds the chunk size")
        c = bcod[j]
        if c == CODEC_RAW and bst[j] != braw[j]:
            raise FormatError(f"raw blob {j} stored size differs from raw size")
        if c == CODEC_ZSTD_DICT and not m.zdict:
            raise FormatError(f"blob {j} needs a dictionary the manifest lacks")
        if c not in CODEC_NAMES:
            raise FormatError(f"blob {j} has unknown codec {c}")
    m._checked = True


def write_manifest(path: str | os.PathLike[str], m: Manifest) -> None:
    atomic_write(path, encode_manifest(m))


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise FormatError(f"no manifest at {os.fspath(path)!r}") from None
    except IsADirectoryError:
        raise FormatError(f"{os.fspath(path)!r} is a directory, not a manifest") from None
    return decode_manifest(data)


def atomic_write(path: str | os.PathLike[str], data: bytes) -> None:
    tmp = f"{os.fspath(path)}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---------------------------------------------------------------- partitions


def partition_header(index: int, dataset_id: int, broadcast: bool) -> bytes:
    flags = PARTITION_FLAG_BROADCAST if broadcast else 0
    h = _PARTITION_HEADER.pack(PARTITION_MAGIC, FORMAT_VERSION, flags, index, dataset_id, 0)
    return h.ljust(PARTITION_DATA_START, b"\0")


def check_partition_header(data: bytes, index: int, dataset_id: int, name: str) -> None:
    if len(data) < _PARTITION_HEADER.size:
        raise FormatError(f"partition {name} is truncated (no header)")
    magic, version, _flags, idx, ds, _ = _PARTITION_HEADER.unpack_from(data)
    if magic != PARTITION_MAGIC:
        raise FormatError(f"partition {name}: bad magic")
    if version != FORMAT_VERSION:
        raise FormatError(f"partition {name}: format version {version} unsupported")
    if idx != index or ds != dataset_id:
        raise FormatError(f"partition {name} belongs to another dataset or slot")


def partition_name(index: int, broadcast: bool = False) -> str:
    return f"bcast-{index:05d}.fsp" if broadcast else f"part-{index:05d}.fsp"


# ---------------------------------------------------------------- blobs


class BlobCodec:
    """Decode and verify stored blob bytes (thread-safe: one decompressor per call)."""

    def __init__(self, zdict: bytes = b""):
        self._zdict = zstandard.ZstdCompressionDict(zdict) if zdict else None

    def decode(
        self, stored: bytes | memoryview, codec: int, raw_len: int, digest: int, where: str
    ) -> bytes:
        if codec == CODEC_RAW:
            raw = stored if isinstance(stored, bytes) else bytes(stored)
        else:
            try:
                if codec == CODEC_ZSTD_DICT:
                    d = zstandard.ZstdDecompressor(dict_data=self._zdict)
                else:
                    d = zstandard.ZstdDecompressor()
                raw = d.decompress(stored, max_output_size=raw_len)
            except zstandard.ZstdError as e:
                raise ChecksumError(f"{where}: corrupt compressed blob ({e})") from None
        if len(raw) != raw_len:
            raise ChecksumError(f"{where}: decoded {len(raw)} bytes, expected {raw_len}")
        if checksum(raw) != digest:
            raise ChecksumError(f"{where}: xxh3 checksum mismatch")
        return raw
