"""The read-only namespace of a prepped dataset: name lookup and attributes by entry index.

Entry index i is inode i + 1 (so the root is inode 1, pyfuse3.ROOT_INODE) on every node.
"""

from __future__ import annotations

import stat
from bisect import bisect_left
from dataclasses import dataclass

from ._errors import NotADirectory, NotFound
from ._format import KIND_DIR, KIND_FILE, KIND_LINK, Manifest


@dataclass(slots=True)
class Record:
    """Everything the FUSE layer needs to answer lookup/getattr/readdir for one entry."""

    index: int
    name: bytes
    kind: int
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    size: int
    first: int  # dir: first child; file: first blob; symlink: offset into links
    count: int  # dir: children; file: blobs
    nlink: int
    atime_ns: int = 0  # written entries only (0: as mtime_ns)
    ctime_ns: int = 0  # written entries only (0: as mtime_ns)

    @property
    def inode(self) -> int:
        return self.index + 1

    @property
    def is_dir(self) -> bool:
        return self.kind == KIND_DIR


class Namespace:
    def __init__(self, manifest: Manifest):
        self.m = manifest
        e = manifest.entries
        self._parent, self._kind, self._mode = e["parent"], e["kind"], e["mode"]
        self._uid, self._gid, self._mtime = e["uid"], e["gid"], e["mtime_ns"]
        self._size, self._first, self._count = e["size"], e["first"], e["count"]
        self._names, self._off = manifest.names, manifest.name_off
        self._subdirs: dict[int, int] = {}

    def __len__(self) -> int:
        return self.m.n_entries

    def name(self, i: int) -> bytes:
        return bytes(self._names[self._off[i] : self._off[i + 1]])

    def path(self, i: int) -> bytes:
        return self.m.path(i)

    def parent(self, i: int) -> int:
        return self._parent[i]

    def record(self, i: int) -> Record:
        k = self._kind[i]
        return Record(
            i, self.name(i), k, self._mode[i], self._uid[i], self._gid[i], self._mtime[i],
            self._size[i], self._first[i], self._count[i], self._nlink(i, k),
        )

    def _names_of(self, lo: int, hi: int) -> list[bytes]:
        """Names of entries lo..hi-1, the name heap read once."""
        off = self._off[lo : hi + 1].tolist()
        heap = bytes(self._names[off[0] : off[-1]])
        base = off[0]
        return [heap[a - base : z - base] for a, z in zip(off, off[1:])]

    def records(self, lo: int, hi: int) -> list[Record]:
        """Records of entries lo..hi-1 (a listing's slice), the columns read a slice at a time."""
        if hi <= lo:
            return []
        cols = [c[lo:hi].tolist() for c in (self._kind, self._mode, self._uid, self._gid,
                                            self._mtime, self._size, self._first, self._count)]
        return [
            Record(i, name, k, md, u, g, t, sz, f, c, 1 if k != KIND_DIR else self._nlink(i, k))
            for i, name, k, md, u, g, t, sz, f, c in zip(range(lo, hi), self._names_of(lo, hi),
                                                         *cols)
        ]

    def listing(self, i: int, start: int, limit: int) -> list[Record]:
        """Up to `limit` children of directory `i` from position `start`."""
        kids = self.children(i)[start : start + limit]
        return self.records(kids.start, kids.stop)

    def names(self, i: int, start: int, limit: int) -> tuple[int, list[bytes], list[int]]:
        """`listing` with names and modes only (a plain READDIR): the first child's index,
        the names, the modes."""
        kids = self.children(i)[start : start + limit]
        lo, hi = kids.start, kids.stop
        if hi <= lo:
            return lo, [], []
        return lo, self._names_of(lo, hi), self._mode[lo:hi].tolist()

    def _nlink(self, i: int, kind: int) -> int:
        if kind != KIND_DIR:
            return 1
        n = self._subdirs.get(i)
        if n is None:
            c0 = self._first[i]
            kinds = self._kind
            n = 2 + sum(1 for j in range(c0, c0 + self._count[i]) if kinds[j] == KIND_DIR)
            self._subdirs[i] = n
        return n

    def lookup(self, parent: int, name: bytes) -> int:
        """Index of `name` in directory `parent` (binary search over sorted children)."""
        if self._kind[parent] != KIND_DIR:
            raise NotADirectory(f"entry {parent} is not a directory")
        if name == b".":
            return parent
        if name == b"..":
            return self._parent[parent]
        lo = self._first[parent]
        hi = lo + self._count[parent]
        j = bisect_left(range(lo, hi), name, key=self.name) + lo
        if j < hi and self.name(j) == name:
            return j
        raise NotFound(f"{name!r} not found")

    def resolve(self, path: bytes) -> int:
        """Index of a dataset-relative path (b"" is the root); symlinks are not followed."""
        i = 0
        for part in path.split(b"/"):
            if part:
                i = self.lookup(i, part)
        return i

    def children(self, i: int) -> range:
        if self._kind[i] != KIND_DIR:
            raise NotADirectory(f"entry {i} is not a directory")
        c0 = self._first[i]
        return range(c0, c0 + self._count[i])

    def blobs(self, i: int) -> range:
        if self._kind[i] != KIND_FILE:
            return range(0)
        c0 = self._first[i]
        return range(c0, c0 + self._count[i])

    def readlink(self, i: int) -> bytes:
        if self._kind[i] != KIND_LINK:
            raise NotFound(f"entry {i} is not a symlink")
        return self.m.link(i)

    def is_dir(self, i: int) -> bool:
        return bool(self._kind[i] == KIND_DIR)

    def is_regular(self, i: int) -> bool:
        return stat.S_ISREG(self._mode[i])
