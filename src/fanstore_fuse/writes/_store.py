"""`WriteStore`: the files and directories written into the mount on this node.

Pure library code: no FUSE, no MPI (see docs/semantics.md for the guarantees). A file's bytes
are written in place with ``pwrite`` under ``LOCAL/writes/data/`` (see `_journal` for the
layout). ``close`` (of a handle that changed the file) and ``fsync`` *commit* it: the data file
is fsync'd, its size, one xxh3-64 per ``CHUNK`` and the file's digest (the xxh3 of those, see
`_hashing`) are appended to the journal, and the journal is fsync'd. Only the chunks changed
since the last commit are hashed again (`Entry.changed_chunks`; appends as they are written).
Namespace changes (mkdir, create, link, unlink, rmdir, rename, chmod/utimens, xattrs) are
journal records too; mkdir, unlink, rmdir and a rename that replaces a file are fsync'd before
they return. Other renames and links are appended and made durable by the next fsync'd record
(a commit, mkdir...): they cost no fsync, and the journal stays a prefix of what happened
whatever a crash cuts off.

Locking: one lock guards the in-memory state and is held only for memory work and short
``pwrite``/``pread`` calls. Every fsync (data file, journal, directory) and the hashing of a
file at commit run *without* the lock, so a 1 GB checkpoint being committed does not
stop lookups, listings or other files' reads and writes. A commit re-checks afterwards that
the file did not change meanwhile (`Entry.version`), and hashes again if it did.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Iterator

from .._errors import (
    ChecksumError,
    Exists,
    InvalidArgument,
    IsADirectory,
    NoData,
    NotADirectory,
    NotCommitted,
    NotEmpty,
    NotFound,
    NotPermitted,
    Unsupported,
    os_error,
)
from .._format import KIND_DIR, KIND_FILE, KIND_LINK, checksum
from .._namespace import Record
from ._files import FileStore
from ._hashing import CHUNK
from ._tree import KIND_NODE, CommitInfo, PathLike, split_path

log = logging.getLogger("fanstore_fuse.writes")

XATTR_NAME_MAX = 255
XATTR_SIZE_MAX = 64 << 10  # Linux's limit for one value
XATTR_COUNT_MAX = 1024  # attributes per entry (they live in memory and in the journal)


class WriteStore(FileStore):
    """Files and directories written into the mount on this node (see the module docstring)."""

    # ------------------------------------------------------------ namespace

    def exists(self, path: PathLike) -> bool:
        with self._lock:
            try:
                self.tree.entry(path)
                return True
            except (NotFound, NotADirectory):
                return False

    def getattr(self, path: PathLike) -> Record:
        with self._lock:
            parts = split_path(path)
            return self.tree.record(self.tree.walk(parts), parts[-1] if parts else None)

    def lookup(self, parent: PathLike, name: bytes) -> Record:
        with self._lock:
            k = self.tree.entry(parent).kids.get(name)
            if k is None:
                raise NotFound(f"{name!r} not found")
            return self.tree.record(self.tree.ents[k], name)

    def listdir(self, path: PathLike) -> list[Record]:
        """Children sorted by name (the mount view merges them with dataset children)."""
        with self._lock:
            d = self.tree.entry(path)
            return [self.tree.record(self.tree.ents[d.kids[n]], n) for n in sorted(d.kids)]

    def names(self, path: PathLike) -> list[bytes]:
        """Every path of the entry at `path` (several for a file with hard links)."""
        with self._lock:
            e = self.tree.entry(path)
            return [self.tree.path_of(self.tree.ents[p]) + b"/" + n if p else n
                    for p, n in e.names()]

    def subtree(self, path: PathLike) -> list[bytes]:
        """`path` and, for a directory, every path below it (parents first)."""
        with self._lock:
            e = self.tree.entry(path)
            top = b"/".join(split_path(path))
            below = self.tree.below(e, top) if e.kind == KIND_DIR else []
            return [top] + [p for p, _ in below]

    def _mkdir(self, path: PathLike, mode: int, shadow: bool, uid: int | None,
               gid: int | None) -> Record:
        parent, e = self._new_entry(path, KIND_DIR, mode, uid, gid, shadow)
        self._log_new(parent, e)
        self.tree.add(parent, e)
        parent.touch(e.mtime_ns)
        return self.tree.record(e)

    def mkdir(self, path: PathLike, mode: int = 0o755, shadow: bool = False,
              uid: int | None = None, gid: int | None = None) -> Record:
        with self._lock:
            rec = self._mkdir(path, mode, shadow, uid, gid)
        self._sync()
        return rec

    def symlink(self, path: PathLike, target: bytes, uid: int | None = None,
                gid: int | None = None) -> Record:
        return self._node(path, KIND_LINK, stat.S_IFLNK | 0o777, uid, gid, target=target)

    def mknod(self, path: PathLike, mode: int, rdev: int = 0, uid: int | None = None,
              gid: int | None = None) -> Record:
        """A fifo, socket or device node (the kernel checked the caller may make it)."""
        if stat.S_IFMT(mode) not in (stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK):
            raise InvalidArgument(f"mknod of mode {mode:#o} is not supported")
        return self._node(path, KIND_NODE, mode, uid, gid, rdev=rdev)

    def _node(self, path: PathLike, kind: int, mode: int, uid: int | None, gid: int | None,
              target: bytes = b"", rdev: int = 0) -> Record:
        with self._lock:
            parent, e = self._new_entry(path, kind, mode, uid, gid)
            e.target, e.rdev = target, rdev
            self._log_new(parent, e)
            self.tree.add(parent, e)
            parent.touch(e.mtime_ns)
            rec = self.tree.record(e)
        self._sync()
        return rec

    def readlink(self, path: PathLike) -> bytes:
        with self._lock:
            e = self.tree.entry(path)
            if e.kind != KIND_LINK:
                raise InvalidArgument(f"{path!r} is not a symlink")
            return e.target

    def makedirs_shadow(self, path: PathLike) -> None:
        """Make sure every directory of `path` exists here, as shadows of dataset directories.

        Called before a create/mkdir inside a dataset directory; shadow directories are
        structure only (stage-out recreates them; they are not written dirs).
        """
        made = False
        with self._lock:
            parts = split_path(path)
            for i in range(1, len(parts) + 1):
                try:
                    e = self.tree.walk(parts[:i])
                except NotFound:
                    self._mkdir(b"/".join(parts[:i]), 0o755, True, None, None)
                    made = True
                    continue
                if e.kind != KIND_DIR:
                    raise NotADirectory(f"{b'/'.join(parts[:i])!r} is not a directory")
        if made:
            self._sync()

    def rmdir(self, path: PathLike) -> None:
        with self._lock:
            parent, name, e = self.tree.child(path)
            if e.kind != KIND_DIR:
                raise NotADirectory(f"{path!r} is not a directory")
            if e.children:
                raise NotEmpty(f"{path!r} is not empty")
            self._log({"o": "rmdir", "p": parent.k, "n": name})
            self._gone(self.tree.detach(parent, name))
            parent.touch(time.time_ns())
        self._sync()

    def unlink(self, path: PathLike) -> None:
        with self._lock:
            parent, name, e = self.tree.child(path)
            if e.kind == KIND_DIR:
                raise IsADirectory(f"{path!r} is a directory")
            self._log({"o": "unlink", "p": parent.k, "n": name})
            self._gone(self.tree.detach(parent, name))
            now = time.time_ns()
            parent.touch(now)
            e.ctime_ns = now  # its other names (if any) see the link count change
        self._sync()

    def link(self, old: PathLike, new: PathLike) -> Record:
        """link(2): another name for the non-directory at `old` (EEXIST if `new` exists)."""
        with self._lock:
            e = self.tree.entry(old)
            if e.kind == KIND_DIR:
                raise NotPermitted(f"{old!r} is a directory")
            parent, name = self.tree.parent_and_name(new)
            if name in parent.kids:
                raise Exists(f"{new!r} exists")
            now = time.time_ns()
            self._log({"o": "link", "k": e.k, "p": parent.k, "n": name, "t": now})
            self.tree.link(e, parent, name)
            e.ctime_ns = now
            parent.touch(now)
            return self.tree.record(e, name)

    def rename(self, old: PathLike, new: PathLike, noreplace: bool = False) -> None:
        """POSIX rename(2) within the written namespace (RENAME_NOREPLACE via `noreplace`)."""
        with self._lock:
            op, on = self.tree.parent_and_name(old)
            np_, nn = self.tree.parent_and_name(new)
            if on not in op.kids:
                raise NotFound(f"{old!r} not found")
            if noreplace and nn in np_.kids:
                raise Exists(f"{new!r} exists")
            self.tree.check_rename(op, on, np_, nn)
            self._log({"o": "rename", "p": op.k, "n": on, "q": np_.k, "w": nn})
            gone = self.tree.move(op.k, on, np_.k, nn)
            self._gone(gone)
        if gone:  # a replaced file's data is gone: the record that says so must not be lost
            self._sync()

    def _set_attrs(self, path: PathLike, mode: int | None, mtime_ns: int | None,
                   uid: int | None = None, gid: int | None = None,
                   atime_ns: int | None = None) -> Record:
        with self._lock:
            e = self.tree.entry(path)
            m = None if mode is None else stat.S_IFMT(e.mode) | (mode & 0o7777)
            t = None if mtime_ns is None else int(mtime_ns)
            a = None if atime_ns is None else int(atime_ns)
            now = time.time_ns()
            owner = {} if uid is None and gid is None else {"u": uid, "g": gid}
            self._log({"o": "attr", "k": e.k, "m": m, "t": t, **owner, "a": a, "c": now})
            e.mode = e.mode if m is None else m
            e.mtime_ns = e.mtime_ns if t is None else t
            e.atime_ns = e.atime_ns if a is None else a
            e.uid = e.uid if uid is None else uid
            e.gid = e.gid if gid is None else gid
            e.ctime_ns = now
            e.attrs_to_commit()
            return self.tree.record(e)

    def chown(self, path: PathLike, uid: int | None, gid: int | None) -> Record:
        """Record a new owner and/or group (the kernel checked the caller may: default_permissions)."""
        return self._set_attrs(path, None, None, uid, gid)

    def chmod(self, path: PathLike, mode: int) -> Record:
        return self._set_attrs(path, mode, None)

    def utimens(self, path: PathLike, mtime_ns: int | None, atime_ns: int | None = None) -> Record:
        return self._set_attrs(path, None, mtime_ns, atime_ns=atime_ns)

    # ------------------------------------------------------------ extended attributes

    def getxattr(self, path: PathLike, name: bytes) -> bytes:
        with self._lock:
            value = (self.tree.entry(path).xattrs or {}).get(name)
        if value is None:
            raise NoData(f"no attribute {name!r}")
        return value

    def listxattr(self, path: PathLike) -> list[bytes]:
        with self._lock:
            return sorted(self.tree.entry(path).xattrs or {})

    def xattrs(self, path: PathLike) -> dict[bytes, bytes]:
        with self._lock:
            return dict(self.tree.entry(path).xattrs or {})

    def setxattr(self, path: PathLike, name: bytes, value: bytes | None) -> None:
        """Set (or, with None, remove: ENODATA if absent) a ``user.*`` attribute."""
        if not name.startswith(b"user.") or len(name) > XATTR_NAME_MAX:
            raise Unsupported(f"attribute {name!r}: only user.* names are kept", errno.ENOTSUP)
        if value is not None and len(value) > XATTR_SIZE_MAX:
            raise Unsupported(f"attribute {name!r}: {len(value)} bytes is too big", errno.E2BIG)
        with self._lock:
            e = self.tree.entry(path)
            xs = dict(e.xattrs or {})
            if value is None:
                if xs.pop(name, None) is None:
                    raise NoData(f"no attribute {name!r}")
            elif len(xs) >= XATTR_COUNT_MAX and name not in xs:
                raise Unsupported(f"more than {XATTR_COUNT_MAX} attributes", errno.ENOSPC)
            else:
                xs[name] = bytes(value)
            self._log({"o": "xattr", "k": e.k, "n": name, "v": value})
            e.xattrs = xs or None
            e.ctime_ns = time.time_ns()
    # ------------------------------------------------------------ export (close-to-open)

    def committed(self, path: PathLike) -> CommitInfo:
        """The last closed/fsync'd version (size, xxh3, mtime, mode, chunks); NotCommitted if none."""
        with self._lock:
            e = self.tree.entry(path)
            if e.kind == KIND_DIR:
                raise IsADirectory(f"{path!r} is a directory")
            if e.commit is None:
                raise NotCommitted(f"{path!r} has not been closed yet")
            return e.commit

    commit_info = committed

    def read_committed_chunk(self, path: PathLike, index: int) -> bytes:
        """Chunk `index` (CHUNK bytes) of the committed version, verified against its xxh3.

        A file rewritten after its last close fails verification for the changed chunks:
        the caller gets ChecksumError (EIO), never bytes of a different version.
        """
        with self._lock:
            data_path = self._data_path(self.tree.entry(path).k)
            c = self.committed(path)
        if index < 0 or index * CHUNK >= max(c.size, 1) or index >= len(c.chunks):
            raise InvalidArgument(f"chunk {index} is outside {path!r}")
        n = min(CHUNK, c.size - index * CHUNK)
        try:
            fd = os.open(data_path, os.O_RDONLY)
            try:
                data = os.pread(fd, n, index * CHUNK) if n else b""
            finally:
                os.close(fd)
        except OSError as err:
            raise os_error(err, f"read {path!r}") from None
        if len(data) != n or checksum(data) != c.chunks[index]:
            raise ChecksumError(
                f"{os.fsdecode(path)}: chunk {index} does not match its committed checksum "
                "(changed since the last close?)"
            )
        return data

    def read_span(self, path: PathLike, off: int, n: int) -> bytes:
        """`n` bytes at `off` of a written file's data as they are now (at most CHUNK). A
        reader on another rank verifies them against the checksum of the commit it saw."""
        if not 0 <= n <= CHUNK or off < 0:
            raise InvalidArgument(f"span {off}+{n} of {path!r}")
        with self._lock:
            data_path = self._data_path(self.tree.entry(path).k)
        try:
            fd = os.open(data_path, os.O_RDONLY)
            try:
                return os.pread(fd, n, off) if n else b""
            finally:
                os.close(fd)
        except OSError as err:
            raise os_error(err, f"read {path!r}") from None

    def read_committed(self, path: PathLike, off: int, size: int) -> bytes:
        """Bytes [off, off+size) of the committed version (clipped to its size), verified."""
        c = self.committed(path)
        end = min(c.size, off + max(size, 0))
        if off >= end:
            return b""
        parts = []
        for k in range(off // CHUNK, (end - 1) // CHUNK + 1):
            data = self.read_committed_chunk(path, k)
            base = k * CHUNK
            parts.append(data[max(off, base) - base : end - base])
        return b"".join(parts)

    # ------------------------------------------------------------ listing for stage-out

    def walk(self) -> Iterator[tuple[bytes, Record, CommitInfo | None, str | None]]:
        """Every entry below the root, parents first: (path, record, commit, data file); a
        file with hard links comes once per name, with the same `Record.inode`."""
        with self._lock:
            out = [(p, self.tree.record(e, p.rpartition(b"/")[2]), e.commit,
                    self._data_path(e.k) if e.kind == KIND_FILE else None)
                   for p, e in self.tree.entries()]
        yield from out

    def is_shadow(self, path: PathLike) -> bool:
        with self._lock:
            return self.tree.entry(path).shadow

    def is_dirty(self, path: PathLike) -> bool:
        """True if the file changed since its last commit (or was never committed)."""
        with self._lock:
            e = self.tree.entry(path)
            return e.kind == KIND_FILE and (e.dirty or e.commit is None)

    def status(self) -> dict[str, int | None]:
        with self._lock:
            files = sum(1 for e in self.tree.ents.values() if e.kind == KIND_FILE)
            return {
                **self.stats.as_dict(),
                "write_used_bytes": self.used_bytes,
                "write_quota_bytes": self.quota_bytes,
                "written_files": files,
                "written_dirs": sum(1 for e in self.tree.ents.values() if e.kind == KIND_DIR) - 1,
                "open_handles": len(self._handles),
            }

    def close_store(self) -> None:
        """Close handles (committing) and the journal. The data stays for stage-out."""
        if not self.readonly:
            self.close_all()
        with self._lock:
            for e in list(self.tree.ents.values()) + list(self._open_unlinked.values()):
                if e.fd >= 0:
                    os.close(e.fd)
                    e.fd = -1
            self.journal.close()

    def __enter__(self) -> WriteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_store()
