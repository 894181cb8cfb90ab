"""The state under a `WriteStore`: lock, entry tree, journal, handles, data files; replay.

See `_store` for what a write store is and how it locks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
import time
from array import array
from dataclasses import dataclass
from typing import Any

from .._errors import (
    BadHandle,
    Exists,
    FanstoreError,
    NotFound,
    QuotaExceeded,
)
from .._format import KIND_DIR, KIND_FILE
from .._namespace import Record
from ._hashing import whole_digest
from ._journal import DATA_DIR, JOURNAL_NAME, WRITES_DIR, Journal
from ._tree import DIR_SIZE, WRITE_INODE_BASE, CommitInfo, Entry, EntryTree, PathLike

log = logging.getLogger("fanstore_fuse.writes")

_COMMIT_TRIES = 3  # unlocked commit attempts before one under the lock (a file kept changing)


@dataclass(slots=True)
class _Handle:
    k: int
    readable: bool
    writable: bool
    append: bool
    changed: bool = False


@dataclass
class WriteStats:
    bytes_written: int = 0  # every byte handed to write()
    commits: int = 0
    enospc: int = 0
    edquot: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)

class StoreBase:
    """Fields and helpers shared by the file and namespace halves of `WriteStore`."""

    def __init__(self, local_dir: str, rank: int = 0, quota_bytes: int | None = None,
                 readonly: bool = False, uid: int | None = None, gid: int | None = None):
        self.local_dir = os.path.abspath(local_dir)
        self.rank = rank
        self.quota_bytes = quota_bytes
        self.readonly = readonly
        self.dir = os.path.join(self.local_dir, WRITES_DIR)
        self.data_dir = os.path.join(self.dir, DATA_DIR)
        self.stats = WriteStats()
        self._lock = threading.RLock()
        self._uid = os.getuid() if uid is None else uid
        self._gid = os.getgid() if gid is None else gid
        self.tree = EntryTree(self._uid, self._gid)
        self._handles: dict[int, _Handle] = {}
        self._open_unlinked: dict[int, Entry] = {}  # unlinked while open: data kept to last close
        self._next_fh = 1
        self._dirents = 1  # data files created (1: those of an earlier daemon); the data dir
        # is durable up to `_dirents_synced`
        self._dirents_synced = 0
        self._dir_lock = threading.Lock()
        self.used_bytes = 0  # sum of the sizes of all live data files
        if not readonly:
            os.makedirs(self.data_dir, mode=0o700, exist_ok=True)
        self.journal = Journal(os.path.join(self.dir, JOURNAL_NAME), readonly)
        for rec in self.journal.replay():
            try:
                self._apply(rec)
            except (FanstoreError, KeyError, TypeError, ValueError) as e:
                self.journal.warn(f"journal record {rec.get('o')!r} does not apply ({e}); skipped")
        self._load_sizes()
        if not readonly:
            self.journal.open_for_append()
            self._collect_garbage()

    @property
    def warnings(self) -> list[str]:
        return self.journal.warnings

    # ------------------------------------------------------------ replay

    def _apply(self, r: dict[str, Any]) -> None:
        op = r["o"]
        t = self.tree
        if op in ("mkdir", "create", "node"):
            kind = KIND_DIR if op == "mkdir" else KIND_FILE if op == "create" else int(r["K"])
            t.add(t.dir(int(r["p"])), Entry(
                int(r["k"]), int(r["p"]), bytes(r["n"]), kind, int(r["m"]), int(r["u"]),
                int(r["g"]), int(r["t"]), size=DIR_SIZE if kind == KIND_DIR else 0,
                children={} if kind == KIND_DIR else None, shadow=bool(r.get("s", False)),
                target=bytes(r.get("l", b"")), rdev=int(r.get("r", 0)),
                ctime_ns=int(r["t"]), atime_ns=int(r["t"])))
        elif op == "commit":
            e = t.get(int(r["k"]))
            c = array("Q")
            c.frombytes(bytes(r["c"]))
            chunks = c.tolist()  # the digest is theirs (version 1 journals: of the bytes)
            e.commit = CommitInfo(int(r["z"]), whole_digest(chunks), int(r["t"]), int(r["m"]), chunks)
            e.mtime_ns, e.mode = e.commit.mtime_ns, e.commit.mode
            e.ctime_ns = max(e.ctime_ns, e.mtime_ns)
        elif op == "unlink" or op == "rmdir":
            self._gone(t.detach(t.dir(int(r["p"])), bytes(r["n"])))
        elif op == "rename":
            self._gone(t.move(int(r["p"]), bytes(r["n"]), int(r["q"]), bytes(r["w"])))
        elif op == "link":
            e = t.get(int(r["k"]))
            t.link(e, t.dir(int(r["p"])), bytes(r["n"]))
            e.ctime_ns = int(r["t"])
        elif op == "xattr":
            e = t.get(int(r["k"]))
            xs = e.xattrs if e.xattrs is not None else {}
            if r["v"] is None:
                xs.pop(bytes(r["n"]), None)
            else:
                xs[bytes(r["n"])] = bytes(r["v"])
            e.xattrs = xs or None
        elif op == "attr":
            e = t.get(int(r["k"]))
            if r.get("m") is not None:
                e.mode = int(r["m"])
            if r.get("t") is not None:
                e.mtime_ns = int(r["t"])
            if r.get("u") is not None:
                e.uid = int(r["u"])
            if r.get("g") is not None:
                e.gid = int(r["g"])
            if r.get("a") is not None:
                e.atime_ns = int(r["a"])
            if r.get("c") is not None:
                e.ctime_ns = int(r["c"])
            e.attrs_to_commit()
        else:
            raise ValueError(f"unknown operation {op!r}")

    def _load_sizes(self) -> None:
        for e in self.tree.ents.values():
            if e.kind == KIND_FILE:
                try:
                    e.size = os.stat(self._data_path(e.k)).st_size
                except FileNotFoundError:
                    e.size = 0
                if e.commit is None or e.size != e.commit.size:
                    e.dirty = True
                self.used_bytes += e.size

    def _collect_garbage(self) -> None:
        live = {f"{k:016x}" for k, e in self.tree.ents.items() if e.kind == KIND_FILE}
        for name in os.listdir(self.data_dir):
            if name not in live:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.data_dir, name))

    # ------------------------------------------------------------ helpers

    def _data_path(self, k: int) -> str:
        return os.path.join(self.data_dir, f"{k:016x}")

    def _gone(self, files: list[Entry]) -> None:
        """Files that left the tree: data removed now, or at the last close if still open."""
        for e in files:
            if e.nopen == 0:
                self._remove_data(e)
            else:
                self._open_unlinked[e.k] = e

    def _remove_data(self, e: Entry) -> None:
        self.used_bytes -= e.size
        if not self.readonly:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._data_path(e.k))

    def _log(self, rec: dict[str, Any]) -> None:
        """Append a journal record (under the lock); callers that need it durable call
        `_sync` after releasing the lock."""
        if self.readonly:
            raise FanstoreError("this write store is open read-only")
        self.journal.append(rec, sync=False)

    def _sync(self) -> None:
        self.journal.sync()

    def _check_quota(self, growth: int) -> None:
        if growth > 0 and self.quota_bytes is not None and self.used_bytes + growth > self.quota_bytes:
            self.stats.edquot += 1
            raise QuotaExceeded(
                f"write quota of {self.quota_bytes} bytes exceeded "
                f"({self.used_bytes} used, {growth} more requested)"
            )

    def _handle(self, fh: int) -> _Handle:
        if fh not in self._handles:
            raise BadHandle(f"file handle {fh} is not open")
        return self._handles[fh]

    def _file(self, h: _Handle) -> Entry:
        e = self.tree.ents.get(h.k) or self._open_unlinked.get(h.k)
        if e is None:
            raise BadHandle(f"file {h.k} is gone")
        return e

    # ------------------------------------------------------------ inodes

    def inode(self, path: PathLike) -> int:
        """The inode of a written path (the written root, b"", answers WRITE_INODE_BASE)."""
        with self._lock:
            return WRITE_INODE_BASE + self.tree.entry(path).k

    def handle_path(self, fh: int) -> bytes | None:
        """Path of the file behind an open handle (None once it was unlinked)."""
        with self._lock:
            e = self.tree.ents.get(self._handle(fh).k)
            if e is None or e.unlinked:
                return None
            return self.tree.path_of(e)

    def record_of(self, inode: int) -> Record:
        """Attributes of a written inode, also of a file unlinked while open (nlink 0)."""
        with self._lock:
            k = inode - WRITE_INODE_BASE
            e = self.tree.ents.get(k) or self._open_unlinked.get(k)
            if e is None:
                raise NotFound(f"written inode {inode} is gone")
            return self.tree.record(e)

    def path(self, inode: int) -> bytes:
        """Mount-relative path of a written inode (NotFound once it is gone)."""
        with self._lock:
            return self.tree.path_of(self.tree.get(inode - WRITE_INODE_BASE))

    def _new_entry(self, path: PathLike, kind: int, mode: int, uid: int | None,
                   gid: int | None, shadow: bool = False) -> tuple[Entry, Entry]:
        """(parent, new entry) for a name that must not exist yet; not yet in the tree."""
        parent, name = self.tree.parent_and_name(path)
        if name in parent.kids:
            raise Exists(f"{path!r} exists")
        bits = {KIND_DIR: stat.S_IFDIR, KIND_FILE: stat.S_IFREG}.get(kind, stat.S_IFMT(mode))
        now = time.time_ns()
        e = Entry(self.tree.next_k, parent.k, name, kind, bits | (mode & 0o7777),
                  self._uid if uid is None else uid, self._gid if gid is None else gid,
                  now, shadow=shadow, ctime_ns=now, atime_ns=now)
        if kind == KIND_DIR:
            e.size, e.children = DIR_SIZE, {}
        return parent, e

    def _log_new(self, parent: Entry, e: Entry) -> None:
        op = {KIND_DIR: "mkdir", KIND_FILE: "create"}.get(e.kind, "node")
        extra = ({"s": e.shadow} if e.kind == KIND_DIR else {"K": e.kind, "l": e.target, "r": e.rdev}
                 if op == "node" else {})
        self._log({"o": op, "k": e.k, "p": parent.k, "n": e.name, "m": e.mode, "u": e.uid,
                   "g": e.gid, "t": e.mtime_ns, **extra})
