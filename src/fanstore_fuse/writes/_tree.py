"""The entry tree of a write store: written files and directories by stable id, in memory.

No I/O and no lock here: `WriteStore` holds the lock, writes the journal and owns the data
files. Written inodes are ``WRITE_INODE_BASE + k`` (k >= 1; k = 0 is the written root, which
stands for the dataset root), disjoint from dataset inodes 1..n_entries.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from .._errors import (
    Exists,
    InvalidArgument,
    IsADirectory,
    NameTooLong,
    NotADirectory,
    NotEmpty,
    NotFound,
)
from .._format import KIND_DIR, KIND_LINK
from .._namespace import Record
from ._hashing import Hasher

WRITE_INODE_BASE = 1 << 40
DIR_SIZE = 4096
KIND_NODE = 3  # a fifo, socket or device node: a name and attributes, no data
PathLike = str | bytes


@dataclass(slots=True)
class CommitInfo:
    """The last committed (closed or fsync'd) version of a written file."""

    size: int
    xxh3: int
    mtime_ns: int
    mode: int
    chunks: list[int]  # xxh3-64 of each CHUNK-sized piece (the last may be shorter)


@dataclass(slots=True, eq=False)
class Entry:
    k: int
    parent: int
    name: bytes
    kind: int
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    size: int = 0
    children: dict[bytes, int] | None = None
    shadow: bool = False  # a directory created only to hold written entries inside a dataset dir
    commit: CommitInfo | None = None
    dirty: bool = False  # changed since the last commit
    version: int = 0  # bumped by every change of the bytes (a commit checks it did not move)
    nopen: int = 0
    fd: int = -1
    unlinked: bool = False
    hasher: Hasher | None = None  # valid while the file has only been appended to
    changed_chunks: set[int] | None = None  # CHUNKs changed since the commit (None: unknown)
    synced_dirent: bool = False
    target: bytes = b""  # a symlink's
    rdev: int = 0  # a device node's

    @property
    def kids(self) -> dict[bytes, int]:
        if self.children is None:
            raise NotADirectory(f"{self.name!r} is not a directory")
        return self.children

    def attrs_to_commit(self) -> None:
        """chmod/utimens apply to the committed version too (what peers and stage-out see)."""
        c = self.commit
        if c is not None:
            self.commit = CommitInfo(c.size, c.xxh3, self.mtime_ns, self.mode, c.chunks)


def _b(path: PathLike) -> bytes:
    return os.fsencode(path) if isinstance(path, str) else bytes(path)


def split_path(path: PathLike) -> list[bytes]:
    """Mount-relative path -> components (leading/trailing/duplicate slashes ignored)."""
    parts = [p for p in _b(path).split(b"/") if p and p != b"."]
    if any(p == b".." for p in parts):
        raise InvalidArgument(f"path {path!r} contains '..'")
    return parts


class EntryTree:
    """Entries by id, with names resolved from the root (see the module docstring)."""

    def __init__(self, uid: int, gid: int) -> None:
        root = Entry(0, 0, b"", KIND_DIR, 0o040755, uid, gid, time.time_ns(), children={},
                     shadow=True)
        self.ents: dict[int, Entry] = {0: root}
        self.next_k = 1

    def get(self, k: int) -> Entry:
        try:
            return self.ents[k]
        except KeyError:
            raise NotFound(f"written entry {k} is gone") from None

    def dir(self, k: int) -> Entry:
        e = self.get(k)
        if e.kind != KIND_DIR:
            raise NotADirectory(f"{self.path_of(e)!r} is not a directory")
        return e

    def path_of(self, e: Entry) -> bytes:
        parts = []
        while e.k != 0:
            parts.append(e.name)
            e = self.ents[e.parent]
        return b"/".join(reversed(parts))

    def walk(self, parts: list[bytes]) -> Entry:
        e = self.ents[0]
        for p in parts:
            if e.kind != KIND_DIR:
                raise NotADirectory(f"{p!r}: a path component is not a directory")
            k = e.kids.get(p)
            if k is None:
                raise NotFound(f"{b'/'.join(parts)!r} not found")
            e = self.ents[k]
        return e

    def entry(self, path: PathLike) -> Entry:
        return self.walk(split_path(path))

    def parent_and_name(self, path: PathLike) -> tuple[Entry, bytes]:
        parts = split_path(path)
        if not parts:
            raise Exists("the root exists")
        name = parts[-1]
        if len(name) > 255:
            raise NameTooLong(f"name too long ({len(name)} bytes)")
        parent = self.walk(parts[:-1])
        if parent.kind != KIND_DIR:
            raise NotADirectory(f"{b'/'.join(parts[:-1])!r} is not a directory")
        return parent, name

    def child(self, path: PathLike) -> tuple[Entry, bytes, Entry]:
        """(parent, name, entry) of an existing path."""
        parent, name = self.parent_and_name(path)
        k = parent.kids.get(name)
        if k is None:
            raise NotFound(f"{path!r} not found")
        return parent, name, self.ents[k]

    def add(self, parent: Entry, e: Entry) -> None:
        if e.name in parent.kids or e.k in self.ents:
            raise Exists(f"{e.name!r} exists")
        self.ents[e.k] = e
        parent.kids[e.name] = e.k
        self.next_k = max(self.next_k, e.k + 1)

    def detach(self, parent: Entry, name: bytes) -> list[Entry]:
        """Remove `name` from `parent` and forget it (and everything below); returns the files."""
        return self._forget(parent.kids.pop(name))

    def _forget(self, k: int) -> list[Entry]:
        e = self.ents.pop(k)
        if e.kind != KIND_DIR:
            e.unlinked = True
            return [e]
        out: list[Entry] = []
        for c in list(e.kids.values()):
            out += self._forget(c)
        return out

    def check_rename(self, op: Entry, on: bytes, np_: Entry, nn: bytes) -> None:
        src = self.ents[op.kids[on]]
        if src.kind == KIND_DIR:
            a = np_
            while True:  # the new parent must not be the source or inside it
                if a.k == src.k:
                    raise InvalidArgument("cannot move a directory into itself")
                if a.k == 0:
                    break
                a = self.ents[a.parent]
        tk = np_.kids.get(nn)
        if tk is None or tk == src.k:
            return
        dst = self.ents[tk]
        if src.kind == KIND_DIR and dst.kind != KIND_DIR:
            raise NotADirectory("cannot replace a file with a directory")
        if src.kind != KIND_DIR and dst.kind == KIND_DIR:
            raise IsADirectory("cannot replace a directory with a file")
        if dst.kind == KIND_DIR and dst.children:
            raise NotEmpty("target directory is not empty")

    def move(self, opk: int, on: bytes, npk: int, nn: bytes) -> list[Entry]:
        """rename(2) of checked arguments; returns the files a replaced target leaves behind."""
        op, np_ = self.dir(opk), self.dir(npk)
        self.check_rename(op, on, np_, nn)
        k = op.kids[on]
        tk = np_.kids.get(nn)
        if tk == k:
            return []
        gone = self._forget(tk) if tk is not None else []
        del op.kids[on]
        np_.kids[nn] = k
        e = self.ents[k]
        e.parent, e.name = np_.k, nn
        op.mtime_ns = np_.mtime_ns = time.time_ns()
        return gone

    def record(self, e: Entry) -> Record:
        if e.kind == KIND_DIR:
            nsub = sum(1 for c in e.kids.values() if self.ents[c].kind == KIND_DIR)
            return Record(WRITE_INODE_BASE + e.k - 1, e.name, KIND_DIR, e.mode, e.uid, e.gid,
                          e.mtime_ns, DIR_SIZE, 0, len(e.kids), 2 + nsub)
        size = len(e.target) if e.kind == KIND_LINK else e.size
        return Record(WRITE_INODE_BASE + e.k - 1, e.name, e.kind, e.mode, e.uid, e.gid,
                      e.mtime_ns, size, e.rdev, 0, 0 if e.unlinked else 1)

    def entries(self) -> list[tuple[bytes, Entry]]:
        """Every entry below the root with its path, parents first (path components order)."""
        out: list[tuple[bytes, Entry]] = []
        stack = [0]
        while stack:
            d = self.ents[stack.pop()]
            for k in d.kids.values():
                e = self.ents[k]
                out.append((self.path_of(e), e))
                if e.kind == KIND_DIR:
                    stack.append(k)
        out.sort(key=lambda t: t[0].split(b"/"))
        return out

