"""The file half of `WriteStore`: handles, reads, writes, truncation and commits.

A commit fsyncs and hashes *without* the store lock (see `_store`); it re-checks the file's
`version` afterwards and starts again when the file changed meanwhile.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from array import array

from .._errors import (
    BadHandle,
    FanstoreError,
    InvalidArgument,
    IsADirectory,
    os_error,
)
from .._format import KIND_DIR, KIND_FILE
from .._fsio import fsync_dir
from .._namespace import Record
from ._base import _COMMIT_TRIES, StoreBase, _Handle
from ._hashing import Hasher, chunks_touched, hash_file, rehash_chunks
from ._tree import CommitInfo, Entry, PathLike

log = logging.getLogger("fanstore_fuse.writes")


class FileStore(StoreBase):
    """Open files of a write store (see the module docstring)."""

    # ------------------------------------------------------------ files

    def create(self, path: PathLike, mode: int = 0o644, flags: int = os.O_WRONLY,
               uid: int | None = None, gid: int | None = None) -> tuple[int, Record]:
        """Create and open a new file (O_EXCL semantics: EEXIST if the name exists)."""
        with self._lock:
            parent, e = self._new_entry(path, KIND_FILE, mode, uid, gid)
            try:
                fd = os.open(self._data_path(e.k), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            except OSError as err:
                raise os_error(err, f"create {path!r}") from None
            try:
                self._log_new(parent, e)
            except FanstoreError:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(self._data_path(e.k))
                raise
            e.dirty, e.fd, e.hasher = True, fd, Hasher()
            self._dirents += 1
            self.tree.add(parent, e)
            parent.touch(e.mtime_ns)
            fh = self._new_handle(e, flags | os.O_CREAT)
            self._handles[fh].changed = True  # a new file is committed on close even if empty
            return fh, self.tree.record(e)

    def _new_handle(self, e: Entry, flags: int) -> int:
        acc = flags & os.O_ACCMODE
        h = _Handle(e.k, acc in (os.O_RDONLY, os.O_RDWR), acc in (os.O_WRONLY, os.O_RDWR),
                    bool(flags & os.O_APPEND))
        if e.fd < 0:
            try:
                e.fd = os.open(self._data_path(e.k), os.O_RDWR if not self.readonly else os.O_RDONLY)
            except OSError as err:
                raise os_error(err, f"open {self.tree.path_of(e)!r}") from None
        e.nopen += 1
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = h
        return fh

    def open(self, path: PathLike, flags: int = os.O_RDONLY) -> int:
        """Open a written file; O_TRUNC truncates. Returns a handle for read/write/close."""
        with self._lock:
            e = self.tree.entry(path)
            if e.kind == KIND_DIR:
                raise IsADirectory(f"{path!r} is a directory")
            if e.kind != KIND_FILE:
                raise InvalidArgument(f"{path!r} has no data to open")
            if self.readonly and flags & (os.O_ACCMODE | os.O_TRUNC):
                raise FanstoreError("this write store is open read-only")
            fh = self._new_handle(e, flags)
            if flags & os.O_TRUNC and flags & os.O_ACCMODE != os.O_RDONLY:
                try:
                    self._truncate(e, 0)
                except FanstoreError:
                    self.close(fh)
                    raise
                self._handles[fh].changed = True
            return fh

    def write(self, fh: int, off: int, data: bytes | memoryview) -> int:
        with self._lock:
            h = self._handle(fh)
            if not h.writable:
                raise BadHandle(f"handle {fh} is not open for writing")
            e = self._file(h)
            if h.append:
                off = e.size
            if off < 0:
                raise InvalidArgument("negative offset")
            n = len(data)
            if n == 0:
                return 0
            self._check_quota(off + n - e.size)
            try:
                written = os.pwrite(e.fd, data, off)
            except OSError as err:
                if err.errno == errno.ENOSPC:
                    self.stats.enospc += 1
                self._resync_size(e)  # a partial write may have grown the file
                raise os_error(err, f"write {self.tree.path_of(e)!r}") from None
            h.changed = e.dirty = True
            e.version += 1
            self.stats.bytes_written += written
            if e.changed_chunks is not None:  # a hole before `off` reads as zeros now
                e.changed_chunks.update(chunks_touched(min(off, e.size), off + written))
            if e.hasher is not None:
                if off == e.hasher.pos and off == e.size and written == n:
                    e.hasher.update(data)
                else:
                    e.hasher = None
            if off + written > e.size:
                self.used_bytes += off + written - e.size
                e.size = off + written
            e.touch(time.time_ns())
            return written

    def _resync_size(self, e: Entry) -> None:
        with contextlib.suppress(OSError):
            size = os.fstat(e.fd).st_size
            if size != e.size:
                self.used_bytes += size - e.size
                e.size = size
                e.hasher = None
                e.changed_chunks = None
                e.dirty = True
                e.version += 1

    def read(self, fh: int, off: int, size: int) -> bytes:
        with self._lock:
            h = self._handle(fh)
            if not h.readable:
                raise BadHandle(f"handle {fh} is not open for reading")
            e = self._file(h)
            if off >= e.size or size <= 0:
                return b""
            if e.atime_ns <= max(e.mtime_ns, e.ctime_ns):  # relatime: once after each change
                e.atime_ns = time.time_ns()
            try:
                return os.pread(e.fd, min(size, e.size - off), off)
            except OSError as err:
                raise os_error(err, f"read {self.tree.path_of(e)!r}") from None

    def truncate(self, path_or_fh: PathLike | int, size: int) -> Record:
        """ftruncate (an int handle) or truncate (a path: committed like open-truncate-close)."""
        if isinstance(path_or_fh, int):
            with self._lock:
                h = self._handle(path_or_fh)
                if not h.writable:
                    raise BadHandle(f"handle {path_or_fh} is not open for writing")
                e = self._file(h)
                self._truncate(e, size)
                h.changed = True
                return self.tree.record(e)
        with self._lock:
            e = self.tree.entry(path_or_fh)
            if e.kind == KIND_DIR:
                raise IsADirectory(f"{path_or_fh!r} is a directory")
            fh = self.open(path_or_fh, os.O_WRONLY)
        try:
            with self._lock:
                self._truncate(e, size)
                self._handles[fh].changed = True
        finally:
            self.close(fh)
        with self._lock:
            return self.tree.record(e)

    def _truncate(self, e: Entry, size: int) -> None:
        if size < 0:
            raise InvalidArgument("negative size")
        self._check_quota(size - e.size)
        try:
            os.ftruncate(e.fd, size)
        except OSError as err:
            raise os_error(err, f"truncate {self.tree.path_of(e)!r}") from None
        self.used_bytes += size - e.size
        if e.changed_chunks is not None:
            e.changed_chunks.update(chunks_touched(min(size, e.size), max(size, e.size)))
        e.size = size
        e.dirty = True
        e.version += 1
        e.touch(time.time_ns())
        if size == 0:
            e.hasher = Hasher()
        elif e.hasher is not None and e.hasher.pos != size:
            e.hasher = None

    # ------------------------------------------------------------ commits

    def fsync(self, fh: int) -> None:
        """Commit the file now (data fsync'd, size + checksums journaled): visible to peers."""
        with self._lock:
            h = self._handle(fh)
            e = self._file(h)
            unlinked, need = e.unlinked, e.dirty or e.commit is None
        if unlinked:
            with contextlib.suppress(OSError):
                os.fsync(e.fd)
        elif need:
            self._commit(e)
        h.changed = False

    def flush(self, fh: int) -> None:
        """FUSE flush (every close(2)): commit if this handle changed the file, so a failed
        commit (ENOSPC, EDQUOT) reaches close(2); `close` (release) then only frees the handle."""
        with self._lock:
            h = self._handle(fh)
            e = self._file(h)
            need = h.changed and not e.unlinked and (e.dirty or e.commit is None)
        if need:
            self._commit(e)
        h.changed = False

    def write_dirtying(self, fh: int, off: int, data: bytes | memoryview) -> tuple[int, bool]:
        """`write`, and whether it made a committed, unchanged file dirty (decided under
        the lock with the write itself, so no commit can fall in between)."""
        with self._lock:
            e = self._file(self._handle(fh))
            clean = not (e.dirty or e.commit is None)
            return self.write(fh, off, data), clean

    def commit_now(self, path: PathLike) -> None:
        """Commit a written file if it changed since its last commit (another rank wants
        its current bytes: close-to-open without FLUSH, see `SharedWrites`)."""
        fh = self.open(path, os.O_RDONLY)  # holds the fd while it commits
        try:
            self.fsync(fh)
        finally:
            self.close(fh)

    def close(self, fh: int) -> float | None:
        """release(): commit if this handle changed the file; the last close frees the fd.
        Returns None if it committed nothing, else the seconds the commit spent hashing (the
        chunks changed in place; 0.0 for a file only appended to: hashed as written)."""
        with self._lock:
            h = self._handle(fh)
            e = self._file(h)
            need = h.changed and not e.unlinked and (e.dirty or e.commit is None)
        rehash = None
        try:
            if need:
                rehash = self._commit(e)
        finally:
            with self._lock:
                del self._handles[fh]
                e.nopen -= 1
                if e.nopen == 0:
                    if e.fd >= 0:
                        os.close(e.fd)
                        e.fd = -1
                    if e.unlinked:
                        self._open_unlinked.pop(e.k, None)
                        self._remove_data(e)
        return rehash

    def close_all(self) -> list[bytes]:
        """Close every open handle (committing changed files); returns paths that failed."""
        failed: list[bytes] = []
        for fh in list(self._handles):
            with self._lock:
                h = self._handles.get(fh)
                e = None if h is None else self.tree.ents.get(h.k)
                path = self.tree.path_of(e) if e else b""
            if h is None:
                continue
            try:
                self.close(fh)
            except FanstoreError as err:
                failed.append(path)
                log.error("closing %s: %s", path, err)
        return failed

    def _sync_data_dir(self) -> None:
        """fsync the data dir (new data files' names), shared by concurrent commits as the
        journal's fsync is (`Journal.sync`)."""
        want = self._dirents
        with self._dir_lock:
            if self._dirents_synced >= want:
                return
            upto = self._dirents
            fsync_dir(self.data_dir)
            self._dirents_synced = upto

    def _commit(self, e: Entry) -> float:
        """Commit `e` (the caller holds an open handle of it, not the lock); returns the
        seconds spent hashing (0.0 if its appends were hashed as they came): the chunks changed
        since the last commit, or all of them where that is not known (a replayed journal)."""
        rehash = 0.0
        for attempt in range(_COMMIT_TRIES + 1):
            locked = attempt == _COMMIT_TRIES  # a file that keeps changing: hold the lock
            with contextlib.ExitStack() as held:
                held.enter_context(self._lock)
                fd, size, version, base = e.fd, e.size, e.version, e.commit
                h = e.hasher
                known = h.digest() if h is not None and h.pos == size else None
                changed = None if e.changed_chunks is None else set(e.changed_chunks)
                if not locked:
                    held.close()
                try:
                    os.fsync(fd)
                    began = time.monotonic()
                    if known is not None:
                        digest, chunks = known
                    elif base is not None and changed is not None:  # only what changed
                        digest, chunks = rehash_chunks(fd, size, base.size, base.chunks, changed)
                    else:
                        digest, chunks = hash_file(fd, size)
                    if known is None:
                        rehash += time.monotonic() - began
                except OSError as err:
                    raise os_error(err, f"fsync {self.tree.path_of(e)!r}") from None
                if not e.synced_dirent:
                    self._sync_data_dir()
                    e.synced_dirent = True
                with self._lock:
                    if e.version != version:
                        continue  # written while we hashed: the digest is not of these bytes
                    if known is None:
                        e.hasher = None  # from now on changes are hashed by chunk
                    e.changed_chunks = set()  # what changes from now on is hashed again
                    c = array("Q", chunks)
                    self._log({"o": "commit", "k": e.k, "z": size, "h": digest, "c": c.tobytes(),
                               "t": e.mtime_ns, "m": e.mode})
                    e.commit = CommitInfo(size, digest, e.mtime_ns, e.mode, chunks)
                    e.dirty = False
                    self.stats.commits += 1
            self._sync()
            return rehash
        raise AssertionError("the last try holds the lock: the file cannot change under it")
