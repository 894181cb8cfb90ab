"""A cheap look at a few manifest columns, for summaries that need no full validation."""

from __future__ import annotations

import mmap
import os
from typing import Any

import msgpack

from ._errors import FormatError
from ._format import ENTRY_COLUMNS, SECTIONS, PartitionInfo
from ._manifest import _digest, _header


def read_columns(path: str | os.PathLike[str], names: tuple[str, ...]
                 ) -> tuple[list[PartitionInfo], dict[str, Any]]:
    """The partition table and the named entry columns of the manifest at `path`, each
    section's checksum verified, without validating the whole manifest (a cheap look for
    callers that only summarize columns, such as `_perms.dest_warning`)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 10:
            raise FormatError("manifest is truncated (no header)")
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
    buf = memoryview(mm)
    _, _, table = _header(buf, size)
    where = dict(zip(SECTIONS, table))
    sec = {}
    for name in ("meta", *(f"entries.{k}" for k in names)):
        off, length, want = where[name]
        if _digest(buf, off, length, None) != want:
            raise FormatError(f"manifest checksum mismatch in section {name!r} (corrupt manifest)")
        sec[name] = buf[off : off + length]
    try:
        d = msgpack.unpackb(bytes(sec["meta"]), raw=False, strict_map_key=True)
        parts = [PartitionInfo(str(p[0]), int(p[1]), bool(p[2])) for p in d["partitions"]]
    except Exception as e:  # msgpack raises several types on garbage
        raise FormatError(f"manifest meta section is malformed: {e}") from None
    return parts, {k: sec[f"entries.{k}"].cast(ENTRY_COLUMNS[k]) for k in names}  # type: ignore[call-overload]
