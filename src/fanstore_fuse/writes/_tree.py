"""The entry tree of a write store: written files and directories by stable id, in memory.

No I/O and no lock here: `WriteStore` holds the lock, writes the journal and owns the data
files. Written inodes are ``WRITE_INODE_BASE + k`` (k >= 1; k = 0 is the written root, which
stands for the dataset root), disjoint from dataset inodes 1..n_entries.

A non-directory may have several names (hard links): its first name is ``(parent, name)``,
the others are in ``links``; its data and attributes are the entry's, shared by every name.
It leaves the tree when its last name goes.
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
    ctime_ns: int = 0  # status change (0: as mtime_ns)
    atime_ns: int = 0  # last access, relatime (0: as mtime_ns)
    links: list[tuple[int, bytes]] | None = None  # (parent k, name) of its other names
    xattrs: dict[bytes, bytes] | None = None  # user.* extended attributes

    def touch(self, now: int) -> None:
        """The bytes or the entries changed: mtime and ctime are now."""
        self.mtime_ns = self.ctime_ns = now

    def names(self) -> list[tuple[int, bytes]]:
        """Every (parent k, name) of this entry, the first name first."""
        return [(self.parent, self.name), *(self.links or ())]

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
        """Remove `name` from `parent`; forget its entry (and everything below) if that was its
        last name. Returns the files that left the tree."""
        k = parent.kids.pop(name)
        e = self.ents[k]
        if e.links:
            self._rename_slot(e, (parent.k, name), None)
            e.ctime_ns = time.time_ns()  # its link count changed
            return []
        return self._forget(k)

    def link(self, e: Entry, parent: Entry, name: bytes) -> None:
        """Give non-directory `e` another name (the caller checked that `name` is free)."""
        if e.kind == KIND_DIR:
            raise IsADirectory("a directory cannot have another name")
        if name in parent.kids:
            raise Exists(f"{name!r} exists")
        parent.kids[name] = e.k
        e.links = [*(e.links or ()), (parent.k, name)]

    @staticmethod
    def _rename_slot(e: Entry, old: tuple[int, bytes], new: tuple[int, bytes] | None) -> None:
        """Replace one of `e`'s names by `new` (None: drop it; it has another)."""
        names = e.names()
        i = names.index(old)
        if new is None:
            del names[i]
        else:
            names[i] = new
        (e.parent, e.name), rest = names[0], names[1:]
        e.links = rest or None

    def _forget(self, k: int) -> list[Entry]:
        e = self.ents.pop(k)
        if e.kind != KIND_DIR:
            e.unlinked = True
            return [e]
        out: list[Entry] = []
        for name in list(e.kids):
            out += self.detach(e, name)
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
            return []  # two names of one file: rename(2) does nothing
        gone = self.detach(np_, nn) if tk is not None else []
        del op.kids[on]
        np_.kids[nn] = k
        e = self.ents[k]
        self._rename_slot(e, (op.k, on), (np_.k, nn))
        now = time.time_ns()
        op.touch(now)
        np_.touch(now)
        e.ctime_ns = now
        return gone

    def record(self, e: Entry, name: bytes | None = None) -> Record:
        """The attributes of `e` (shown under `name`, one of its names; default its first)."""
        name = e.name if name is None else name
        times = {"atime_ns": e.atime_ns or e.mtime_ns, "ctime_ns": e.ctime_ns or e.mtime_ns}
        if e.kind == KIND_DIR:
            nsub = sum(1 for c in e.kids.values() if self.ents[c].kind == KIND_DIR)
            return Record(WRITE_INODE_BASE + e.k - 1, name, KIND_DIR, e.mode, e.uid, e.gid,
                          e.mtime_ns, DIR_SIZE, 0, len(e.kids), 2 + nsub, **times)
        size = len(e.target) if e.kind == KIND_LINK else e.size
        nlink = 0 if e.unlinked else 1 + len(e.links or ())
        return Record(WRITE_INODE_BASE + e.k - 1, name, e.kind, e.mode, e.uid, e.gid,
                      e.mtime_ns, size, e.rdev, 0, nlink, **times)

    def entries(self) -> list[tuple[bytes, Entry]]:
        """Every entry below the root with its path, parents first (path components order);
        a file with several names comes once per name."""
        return self.below(self.ents[0], b"")

    def below(self, top: Entry, path: bytes) -> list[tuple[bytes, Entry]]:
        """`entries` of the subtree under directory `top` (at `path`), `top` itself excluded."""
        out: list[tuple[bytes, Entry]] = []
        stack = [(top, path)]
        while stack:
            d, dpath = stack.pop()
            for name, k in d.kids.items():
                e = self.ents[k]
                p = dpath + b"/" + name if dpath else name
                out.append((p, e))
                if e.kind == KIND_DIR:
                    stack.append((e, p))
        out.sort(key=lambda t: t[0].split(b"/"))
        return out

