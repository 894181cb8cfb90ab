"""Crafting raw version-2 manifests for tests: sections out, sections in, headers rewritten with
a valid header checksum (so only validation stands between a crafted file and a reader)."""

from __future__ import annotations

import struct

from fanstore_fuse._format import SECTIONS, checksum
from fanstore_fuse._manifest import _MANIFEST_HEADER, _SECTION, manifest_header, section_digest


def sections(data: bytes) -> dict[str, bytes]:
    hs = _MANIFEST_HEADER.size
    out = {}
    for k, name in enumerate(SECTIONS):
        off, length, _ = _SECTION.unpack_from(data, hs + k * _SECTION.size)
        out[name] = data[off : off + length]
    return out


def build(secs: dict[str, bytes], n_entries: int, n_blobs: int) -> bytes:
    """A manifest from raw sections, laid out and checksummed as prep would."""
    body = [secs[name] for name in SECTIONS]
    out = bytearray(manifest_header(n_entries, n_blobs, [(len(s), section_digest(s)) for s in body]))
    for s in body:
        out += s
        out += bytes(-len(out) % 8)
    return bytes(out)


def counts(data: bytes) -> tuple[int, int]:
    n, nb = struct.unpack_from("<QQ", data, 24)
    return n, nb


def rehead(data: bytes, **fields: int) -> bytes:
    """Change header fields (version, flags, sections, size, entries, blobs) and re-checksum."""
    hs = _MANIFEST_HEADER.size
    magic, version, flags, nsec, size, n, nb, _ = _MANIFEST_HEADER.unpack_from(data)
    v = dict(version=version, flags=flags, sections=nsec, size=size, entries=n, blobs=nb)
    v.update(fields)
    head = _MANIFEST_HEADER.pack(magic, v["version"], v["flags"], v["sections"], v["size"],
                                 v["entries"], v["blobs"], 0)[: hs - 8]
    table = data[hs : hs + nsec * _SECTION.size]
    return head + struct.pack("<Q", checksum(head + table)) + data[hs:]
