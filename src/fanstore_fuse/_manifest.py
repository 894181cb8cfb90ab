"""The manifest file (version 2 layout, see docs/format.md): encode and write, map and check.

The manifest is used in place: a header, a section table, then one section per
column, each a little-endian fixed-width array (or a byte heap). `read_manifest` maps the file
and hands out memoryviews over it, so loading allocates nothing per entry and ranks on one node
share the page cache. Every size is checked against the file before anything is touched.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
import sys
from typing import Any

import msgpack
import xxhash

from ._errors import FormatError
from ._format import (
    BLOB_COLUMNS,
    ENTRY_COLUMNS,
    FORMAT_VERSION,
    HASH_SEED,
    ITEMSIZE,
    MANIFEST_MAGIC,
    MAX_BLOBS,
    MAX_ENTRIES,
    MAX_LINK,
    MAX_META_BYTES,
    MAX_NAME,
    MAX_PARTITIONS,
    MAX_ZDICT_BYTES,
    READ_VERSIONS,
    SECTIONS,
    Manifest,
    PartitionInfo,
    checksum,
)

# magic, version, flags, sections, file size, entries, blobs, xxh3 of bytes 0..40 + section table
_MANIFEST_HEADER = struct.Struct("<8sHHIQQQQ")
_SECTION = struct.Struct("<QQQ")  # offset, length, xxh3 of the section and its zero padding
_DIGEST_STEP = 64 << 20  # checksum this much of a mapped file, then drop its pages


def _align8(n: int) -> int:
    return (n + 7) & ~7


def _meta(m: Manifest) -> bytes:
    return msgpack.packb(
        {
            "format": m.version,
            "dataset_id": m.dataset_id,
            "options": m.options,
            "partitions": [[p.name, p.size, p.broadcast] for p in m.partitions],
        },
        use_bin_type=True,
    )


def _le_bytes(col: Any) -> memoryview:
    mv = memoryview(col)
    if sys.byteorder == "big" and mv.itemsize > 1:  # pragma: no cover - all targets are LE
        from array import array

        a = array(mv.format, mv.tolist())
        a.byteswap()
        mv = memoryview(a)
    return mv.cast("B")


def manifest_sections(m: Manifest) -> list[Any]:
    """The sections of `m`, in SECTIONS order, as byte buffers."""
    return [
        _meta(m),
        *(_le_bytes(m.entries[k]) for k in ENTRY_COLUMNS),
        _le_bytes(m.name_off),
        _le_bytes(m.names),
        _le_bytes(m.links),
        *(_le_bytes(m.blobs[k]) for k in BLOB_COLUMNS),
        _le_bytes(m.zdict),
    ]


def manifest_header(
    n_entries: int, n_blobs: int, sections: list[tuple[int, int]], version: int = FORMAT_VERSION
) -> bytes:
    """Header + section table for sections of (length, padded xxh3), laid out back to back."""
    pos = _align8(_MANIFEST_HEADER.size + _SECTION.size * len(sections))
    table = bytearray()
    for length, digest in sections:
        table += _SECTION.pack(pos, length, digest)
        pos = _align8(pos + length)
    head = _MANIFEST_HEADER.pack(
        MANIFEST_MAGIC, version, 0, len(sections), pos, n_entries, n_blobs, 0
    )[: _MANIFEST_HEADER.size - 8]
    digest = checksum(head + table)
    return head + struct.pack("<Q", digest) + bytes(table)


def section_digest(data: Any) -> int:
    h = xxhash.xxh3_64(seed=HASH_SEED)
    h.update(data)
    h.update(bytes(_align8(len(data)) - len(data)))
    return h.intdigest()


def encode_manifest(m: Manifest) -> bytes:
    secs = manifest_sections(m)
    out = bytearray(
        manifest_header(m.n_entries, m.n_blobs, [(len(s), section_digest(s)) for s in secs],
                        m.version)
    )
    for s in secs:
        out += s
        out += bytes(_align8(len(out)) - len(out))
    return bytes(out)


def write_manifest(path: str | os.PathLike[str], m: Manifest) -> None:
    """Write `m` to `path` atomically, section by section (no second copy in memory)."""
    secs = manifest_sections(m)
    head = manifest_header(
        m.n_entries, m.n_blobs, [(len(s), section_digest(s)) for s in secs], m.version
    )
    tmp = f"{os.fspath(path)}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(head)
        for s in secs:
            f.write(s)
            f.write(bytes(_align8(len(s)) - len(s)))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def decode_manifest(data: bytes | bytearray | memoryview) -> Manifest:
    """Parse and fully validate a manifest held in memory; raise FormatError if bad."""
    return _parse(memoryview(data).cast("B"), None)


def read_manifest(path: str | os.PathLike[str], writable: bool = False,
                  validate: bool = True) -> Manifest:
    """Map and fully validate the manifest at `path`. `writable`: a private copy-on-write
    mapping whose columns may be changed in memory (tests); the file never changes. Without
    `validate` (read-only mappings), only the header, the section checksums and the partition
    table are checked: the caller must call `finish_manifest` before using anything else."""
    p = os.fspath(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FormatError(f"no manifest at {p!r}") from None
    except IsADirectoryError:
        raise FormatError(f"{p!r} is a directory, not a manifest") from None
    except OSError as e:
        raise FormatError(f"manifest {p!r} unreadable: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(f"{p!r} is a directory, not a manifest")
        if st.st_size < 10:
            raise FormatError("manifest is truncated (no header)")
        mm = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_COPY if writable else mmap.ACCESS_READ)
    finally:
        os.close(fd)
    m = _parse(memoryview(mm), None if writable else mm, validate or writable)
    m._keep = mm
    if validate or writable:
        _finished(m, drop=not writable)
    return m


def finish_manifest(m: Manifest, part: int = 0, parts: int = 1) -> int:
    """The validation `read_manifest(..., validate=False)` left out; with `parts` > 1 only the
    `part`-th share of it (the ranks of a mount split the work): it returns the children the
    share's directories list, and the shares' sum must pass `_validate.check_children`."""
    from ._validate import validate

    children = validate(m, part, parts)
    m._checked = parts == 1
    _finished(m, drop=True)
    return children


def header_digest(m: Manifest) -> int:
    """The checksum of the header and section table of a mapped manifest: it covers every
    section's checksum, so two copies with equal digests (each checked) hold the same bytes."""
    return int.from_bytes(bytes(m._keep[_MANIFEST_HEADER.size - 8 : _MANIFEST_HEADER.size]), "little")


def _finished(m: Manifest, drop: bool) -> None:
    if drop:
        m.drop_pages()  # validation touched every page: let them go again
    trim_heap()


def trim_heap() -> None:
    """Give validation's freed temporaries back to the OS (glibc keeps them otherwise)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _digest(buf: memoryview, off: int, n: int, mm: mmap.mmap | None) -> int:
    h = xxhash.xxh3_64(seed=HASH_SEED)
    end = _align8(off + n)
    for a in range(off, end, _DIGEST_STEP):
        b = min(a + _DIGEST_STEP, end)
        h.update(buf[a:b])
        if mm is not None:
            start = a - a % mmap.PAGESIZE
            mm.madvise(mmap.MADV_DONTNEED, start, b - start)
    return h.intdigest()


def _expected_lengths(n: int, nb: int) -> dict[str, tuple[int, int]]:
    """Section name -> (min, max) length allowed for n entries and nb blobs."""
    exp = {f"entries.{k}": (n * ITEMSIZE[t],) * 2 for k, t in ENTRY_COLUMNS.items()}
    exp.update({f"blobs.{k}": (nb * ITEMSIZE[t],) * 2 for k, t in BLOB_COLUMNS.items()})
    exp["name_off"] = ((n + 1) * 8,) * 2
    exp["names"] = (n - 1, MAX_NAME * (n - 1))
    exp["links"] = (0, MAX_LINK * n)
    exp["meta"] = (1, MAX_META_BYTES)
    exp["zdict"] = (0, MAX_ZDICT_BYTES)
    return exp


def _header(buf: memoryview, size: int) -> tuple[int, int, list[tuple[int, int, int]]]:
    """Check the header and section table (the first bytes of `buf`) against the file size
    `size` and the sane limits; return (entries, blobs, table). Reads nothing else."""
    hs = _MANIFEST_HEADER.size
    if size < 10 or len(buf) < 10:
        raise FormatError("manifest is truncated (no header)")
    if bytes(buf[:8]) != MANIFEST_MAGIC:
        raise FormatError("not a fanstore-fuse manifest (bad magic)")
    (version,) = struct.unpack_from("<H", buf, 8)
    if version not in READ_VERSIONS:
        hint = " (written by an older prep: re-run `fanstore-fuse prep`)" if version < 2 else ""
        raise FormatError(
            f"manifest format version {version}, this build reads {READ_VERSIONS[0]}.."
            f"{READ_VERSIONS[-1]}{hint}"
        )
    if len(buf) < hs:
        raise FormatError("manifest is truncated (no header)")
    _, _, flags, nsec, claimed, n, nb, digest = _MANIFEST_HEADER.unpack_from(buf)
    if nsec != len(SECTIONS):
        raise FormatError(f"manifest has {nsec} sections, version {version} has {len(SECTIONS)}")
    table_end = hs + nsec * _SECTION.size
    if len(buf) < table_end:
        raise FormatError("manifest is truncated (no section table)")
    if checksum(bytes(buf[: hs - 8]) + bytes(buf[hs:table_end])) != digest:
        raise FormatError("manifest header checksum mismatch (corrupt manifest)")
    if flags:
        raise FormatError(f"manifest header has unknown flags {flags:#x}")
    if claimed != size:
        raise FormatError(f"manifest is {size} bytes, header says {claimed}")
    if not 1 <= n <= MAX_ENTRIES or not 0 <= nb <= MAX_BLOBS:
        raise FormatError(f"manifest counts out of range: {n} entries, {nb} blobs")
    table = [_SECTION.unpack_from(buf, hs + k * _SECTION.size) for k in range(nsec)]
    exp = _expected_lengths(n, nb)
    pos = _align8(table_end)
    for name, (off, length, _) in zip(SECTIONS, table):
        lo, hi = exp[name]
        if not lo <= length <= hi:
            want = str(lo) if lo == hi else f"{lo}..{hi}"
            raise FormatError(f"manifest column {name!r} has {length} bytes, expected {want}")
        if off != pos:
            raise FormatError(f"manifest section {name!r} at offset {off}, expected {pos}")
        pos = _align8(off + length)
    if pos != size:
        raise FormatError(f"manifest sections end at {pos}, the file has {size} bytes")
    return n, nb, table


def check_manifest_header(path: str | os.PathLike[str]) -> None:
    """The header checks of `read_manifest` alone (before copying a manifest anywhere)."""
    p = os.fspath(path)
    try:
        with open(p, "rb") as f:
            head = f.read(_MANIFEST_HEADER.size + _SECTION.size * len(SECTIONS))
            size = os.fstat(f.fileno()).st_size
    except (FileNotFoundError, IsADirectoryError):
        raise FormatError(f"no manifest at {p!r}") from None
    except OSError as e:
        raise FormatError(f"manifest {p!r} unreadable: {e.strerror}") from None
    _header(memoryview(head), size)


def _parse(buf: memoryview, mm: mmap.mmap | None, validate: bool = True) -> Manifest:
    _, _, table = _header(buf, len(buf))
    for name, (off, length, want) in zip(SECTIONS, table):
        if _digest(buf, off, length, mm) != want:
            raise FormatError(f"manifest checksum mismatch in section {name!r} (corrupt manifest)")
    sec = {name: buf[off : off + length] for name, (off, length, _) in zip(SECTIONS, table)}
    try:
        m = _from_sections(sec, struct.unpack_from("<H", buf, 8)[0])
    except FormatError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise FormatError(f"manifest is malformed: {type(e).__name__}: {e}") from None
    if mm is not None:
        m._keep = mm  # before validation, so its passes can unmap the pages they touched
    if validate:
        validate_manifest(m)
    else:
        from ._validate import check_partitions

        check_partitions(m)
    return m


def _from_sections(sec: dict[str, memoryview], version: int) -> Manifest:
    try:
        d = msgpack.unpackb(bytes(sec["meta"]), raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types on garbage
        raise FormatError(f"manifest meta section is not valid msgpack: {e}") from None
    if not isinstance(d, dict) or d.get("format") != version:
        got = d.get("format") if isinstance(d, dict) else d
        raise FormatError(f"manifest meta format {got!r} unsupported")
    raw_parts, dataset_id, options = d.get("partitions"), d.get("dataset_id"), d.get("options")
    if type(dataset_id) is not int or not 0 <= dataset_id < 1 << 64:
        raise FormatError(f"manifest meta is malformed: dataset_id {dataset_id!r} is not a u64")
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise FormatError("manifest meta is malformed: options is not a map of names")
    if not isinstance(raw_parts, list) or len(raw_parts) > MAX_PARTITIONS:
        raise FormatError("manifest partition table is malformed")
    for i, p in enumerate(raw_parts):
        if (not isinstance(p, list) or len(p) != 3 or type(p[0]) is not str
                or type(p[1]) is not int or type(p[2]) is not bool):
            raise FormatError(f"manifest partition table is malformed: partition {i} is not "
                              "[name, size, broadcast]")
    parts = [PartitionInfo(p[0], p[1], p[2]) for p in raw_parts]
    le = sys.byteorder == "little"
    if not le:  # pragma: no cover
        raise FormatError("big-endian hosts cannot map a manifest in place")
    return Manifest(
        dataset_id=dataset_id,
        options=options,
        partitions=parts,
        entries={k: sec[f"entries.{k}"].cast(t) for k, t in ENTRY_COLUMNS.items()},  # type: ignore[call-overload]
        name_off=sec["name_off"].cast("Q"),
        names=sec["names"],
        links=sec["links"],
        blobs={k: sec[f"blobs.{k}"].cast(t) for k, t in BLOB_COLUMNS.items()},  # type: ignore[call-overload]
        zdict=bytes(sec["zdict"]),
        version=version,
    )


def validate_manifest(m: Manifest) -> None:
    """Refuse anything a hostile or corrupt manifest could use to escape or confuse us."""
    from ._validate import validate  # numpy is imported only where manifests are checked

    validate(m)
    m._checked = True
