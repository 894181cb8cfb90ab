"""Node-local store for the files and directories a job writes into the mount.

Pure library code: no FUSE, no MPI (see docs/semantics.md for the guarantees).

Layout under ``local_dir/writes/``::

    journal.fwj          append-only metadata journal (header + checksummed msgpack records)
    data/<k:016x>        the bytes of written file k (stable ids: user names never touch disk)

A file's bytes are written in place with ``pwrite``. ``close`` (of a handle that changed the file)
and ``fsync`` *commit* it: the data file is fsync'd, its size, xxh3-64 (``HASH_SEED``) and one
xxh3-64 per ``CHUNK`` bytes are appended to the journal, and the journal is fsync'd. Namespace
changes (mkdir, create, unlink, rmdir, rename, chmod/utimens) are journal records too; mkdir,
unlink, rmdir and rename are fsync'd at once. Replaying the journal rebuilds the namespace; a
torn or corrupt record ends the replay with a warning (the records before it stand).

Written inodes are ``WRITE_INODE_BASE + k`` (k >= 1; k = 0 is the written root, which stands for
the dataset root): disjoint from dataset inodes 1..n_entries. `getattr` returns a
`fanstore_fuse._namespace.Record` whose ``inode`` property is that number, so the FUSE layer's
attribute code works unchanged.

Blocking: writes, commits (hash + fsync) and reads do disk I/O; the FUSE layer should run big
ones in a worker thread. Every public method takes one lock, so that is safe.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import struct
import threading
import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack
import xxhash

from ._errors import ChecksumError, FanstoreError, FormatError, NotADirectory, NotFound
from ._format import HASH_SEED, KIND_DIR, KIND_FILE, checksum
from ._namespace import Record

log = logging.getLogger("fanstore_fuse.writes")

WRITE_INODE_BASE = 1 << 40
CHUNK = 4 << 20  # granularity of the per-chunk checksums (remote reads are verified per chunk)
JOURNAL_NAME = "journal.fwj"
JOURNAL_MAGIC = b"FSTRWJNL"
JOURNAL_VERSION = 1
_JHEADER = struct.Struct("<8sHHI")  # magic, version, flags, reserved (16 bytes)
_RHEADER = struct.Struct("<IQ")  # payload length, xxh3-64 of the payload
MAX_RECORD = 16 << 20
_DIR_SIZE = 4096
PathLike = str | bytes


# ---------------------------------------------------------------- errors


class Exists(FanstoreError):
    errno = errno.EEXIST


class IsADirectory(FanstoreError):
    errno = errno.EISDIR


class NotEmpty(FanstoreError):
    errno = errno.ENOTEMPTY


class NoSpace(FanstoreError):
    """The local disk is full (ENOSPC from the OS). Earlier data is untouched."""

    errno = errno.ENOSPC


class QuotaExceeded(FanstoreError):
    """The write quota (``--write-quota``) would be exceeded."""

    errno = errno.EDQUOT


class BadHandle(FanstoreError):
    errno = errno.EBADF


class InvalidArgument(FanstoreError):
    errno = errno.EINVAL


class NotCommitted(FanstoreError):
    """The file was never closed/fsync'd: there is no committed version to export."""

    errno = errno.ENOENT


def _os_error(e: OSError, what: str) -> FanstoreError:
    if e.errno == errno.ENOSPC:
        return NoSpace(f"{what}: no space left on the local disk")
    if e.errno == errno.EDQUOT:
        return QuotaExceeded(f"{what}: disk quota exceeded")
    err = FanstoreError(f"{what}: {e.strerror or e}")
    err.errno = e.errno or errno.EIO
    return err


# ---------------------------------------------------------------- values


class Committed(NamedTuple):
    """The last committed (closed or fsync'd) version of a written file."""

    size: int
    xxh3: int
    mtime_ns: int
    mode: int


@dataclass(slots=True)
class CommitInfo:
    size: int
    xxh3: int
    mtime_ns: int
    mode: int
    chunks: list[int]  # xxh3-64 of each CHUNK-sized piece (the last may be shorter)

    def public(self) -> Committed:
        return Committed(self.size, self.xxh3, self.mtime_ns, self.mode)


class _Hasher:
    """Whole-file and per-chunk xxh3 of a stream of appended bytes."""

    __slots__ = ("whole", "part", "part_len", "chunks", "pos")

    def __init__(self) -> None:
        self.whole = xxhash.xxh3_64(seed=HASH_SEED)
        self.part = xxhash.xxh3_64(seed=HASH_SEED)
        self.part_len = 0
        self.chunks: list[int] = []
        self.pos = 0

    def update(self, data: bytes | memoryview) -> None:
        mv = memoryview(data)
        self.whole.update(mv)
        self.pos += len(mv)
        while len(mv):
            take = min(len(mv), CHUNK - self.part_len)
            self.part.update(mv[:take])
            self.part_len += take
            mv = mv[take:]
            if self.part_len == CHUNK:
                self.chunks.append(self.part.intdigest())
                self.part = xxhash.xxh3_64(seed=HASH_SEED)
                self.part_len = 0

    def digest(self) -> tuple[int, list[int]]:
        chunks = list(self.chunks)
        if self.part_len or not chunks:
            chunks.append(self.part.intdigest())
        return self.whole.intdigest(), chunks


def hash_file(fd: int, size: int) -> tuple[int, list[int]]:
    """(xxh3, chunk xxh3s) of the first `size` bytes of an open file."""
    h = _Hasher()
    off = 0
    while off < size:
        data = os.pread(fd, min(CHUNK, size - off), off)
        if not data:
            raise ChecksumError(f"data file is shorter ({off} bytes) than its recorded size {size}")
        h.update(data)
        off += len(data)
    return h.digest()


@dataclass(slots=True, eq=False)
class _Ent:
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
    nopen: int = 0
    fd: int = -1
    unlinked: bool = False
    hasher: _Hasher | None = None  # valid while the file has only been appended to
    synced_dirent: bool = False


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


def _b(path: PathLike) -> bytes:
    return os.fsencode(path) if isinstance(path, str) else bytes(path)


def split_path(path: PathLike) -> list[bytes]:
    """Mount-relative path -> components (leading/trailing/duplicate slashes ignored)."""
    parts = [p for p in _b(path).split(b"/") if p and p != b"."]
    if any(p == b".." for p in parts):
        raise InvalidArgument(f"path {path!r} contains '..'")
    return parts


# ---------------------------------------------------------------- journal


class Journal:
    """Append-only, checksummed msgpack records; see the module docstring."""

    def __init__(self, path: str, readonly: bool = False):
        self.path = path
        self.readonly = readonly
        self.warnings: list[str] = []
        self.fd = -1
        self.end = 0

    def replay(self) -> Iterator[dict[str, Any]]:
        """Yield the valid records; stop (with a warning) at the first torn or corrupt one."""
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self.end = 0
            return
        if len(data) < _JHEADER.size:
            if data:
                self._warn(f"journal {self.path} has a truncated header; starting empty")
            self.end = 0
            return
        magic, version, flags, reserved = _JHEADER.unpack_from(data)
        if magic != JOURNAL_MAGIC:
            raise FormatError(f"{self.path} is not a fanstore-fuse write journal (bad magic)")
        if version != JOURNAL_VERSION or flags or reserved:
            raise FormatError(f"{self.path}: journal version {version} flags {flags:#x} unsupported")
        off = _JHEADER.size
        n = 0
        while off < len(data):
            if off + _RHEADER.size > len(data):
                self._warn(f"journal record {n} at offset {off} is torn (short header); ignored")
                break
            length, digest = _RHEADER.unpack_from(data, off)
            body = data[off + _RHEADER.size : off + _RHEADER.size + length]
            if length > MAX_RECORD or len(body) != length:
                self._warn(f"journal record {n} at offset {off} is torn ({length} bytes); ignored")
                break
            if checksum(body) != digest:
                self._warn(f"journal record {n} at offset {off} fails its checksum; it and later "
                           "records are ignored")
                break
            try:
                rec = msgpack.unpackb(body, raw=False)
            except Exception as e:  # msgpack raises several types
                self._warn(f"journal record {n} at offset {off} does not decode ({e}); ignored")
                break
            off += _RHEADER.size + length
            n += 1
            if isinstance(rec, dict):
                yield rec
            else:
                self._warn(f"journal record {n} is not a map; skipped")
        self.end = off

    def _warn(self, msg: str) -> None:
        log.warning("%s", msg)
        self.warnings.append(msg)

    def open_for_append(self) -> None:
        assert not self.readonly
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            size = os.fstat(fd).st_size
            if self.end == 0:
                os.ftruncate(fd, 0)
                os.pwrite(fd, _JHEADER.pack(JOURNAL_MAGIC, JOURNAL_VERSION, 0, 0), 0)
                os.fsync(fd)
                self.end = _JHEADER.size
            elif size > self.end:  # drop a torn/corrupt tail so new records follow good ones
                os.ftruncate(fd, self.end)
                os.fsync(fd)
        except OSError as e:
            os.close(fd)
            raise _os_error(e, "journal") from None
        self.fd = fd

    def append(self, rec: dict[str, Any], sync: bool) -> None:
        body = msgpack.packb(rec, use_bin_type=True)
        frame = _RHEADER.pack(len(body), checksum(body)) + body
        try:
            n = os.pwrite(self.fd, frame, self.end)
            if n != len(frame):
                raise OSError(errno.ENOSPC, "short write to the journal")
            if sync:
                os.fsync(self.fd)
        except OSError as e:
            # Never leave a torn record that would hide later ones: cut back to the last good one.
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, self.end)
            raise _os_error(e, "journal") from None
        self.end += len(frame)

    def sync(self) -> None:
        try:
            os.fsync(self.fd)
        except OSError as e:
            raise _os_error(e, "journal") from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# ---------------------------------------------------------------- the store


class WriteStore:
    """Files and directories written into the mount on this node (see the module docstring)."""

    def __init__(
        self,
        local_dir: str,
        rank: int = 0,
        quota_bytes: int | None = None,
        readonly: bool = False,
        uid: int | None = None,
        gid: int | None = None,
    ):
        self.local_dir = os.path.abspath(local_dir)
        self.rank = rank
        self.quota_bytes = quota_bytes
        self.readonly = readonly
        self.dir = os.path.join(self.local_dir, "writes")
        self.data_dir = os.path.join(self.dir, "data")
        self.stats = WriteStats()
        self._lock = threading.RLock()
        self._uid = os.getuid() if uid is None else uid
        self._gid = os.getgid() if gid is None else gid
        now = time.time_ns()
        root = _Ent(0, 0, b"", KIND_DIR, stat.S_IFDIR | 0o755, self._uid, self._gid, now,
                    children={}, shadow=True)
        self._ents: dict[int, _Ent] = {0: root}
        self._next_k = 1
        self._handles: dict[int, _Handle] = {}
        self._open_unlinked: dict[int, _Ent] = {}  # unlinked while open: data kept to last close
        self._next_fh = 1
        self.used_bytes = 0  # sum of the sizes of all live data files
        if not readonly:
            os.makedirs(self.data_dir, mode=0o700, exist_ok=True)
        self.journal = Journal(os.path.join(self.dir, JOURNAL_NAME), readonly)
        for rec in self.journal.replay():
            try:
                self._apply(rec)
            except (FanstoreError, KeyError, TypeError, ValueError) as e:
                self.journal._warn(f"journal record {rec.get('o')!r} does not apply ({e}); skipped")
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
        if op in ("mkdir", "create"):
            k = int(r["k"])
            parent = self._dir(int(r["p"]))
            name = bytes(r["n"])
            if name in parent.children or k in self._ents:  # type: ignore[operator]
                raise Exists(f"{name!r} exists")
            kind = KIND_DIR if op == "mkdir" else KIND_FILE
            e = _Ent(k, parent.k, name, kind, int(r["m"]), int(r["u"]), int(r["g"]), int(r["t"]),
                     size=_DIR_SIZE if kind == KIND_DIR else 0,
                     children={} if kind == KIND_DIR else None, shadow=bool(r.get("s", False)))
            self._ents[k] = e
            parent.children[name] = k  # type: ignore[index]
            self._next_k = max(self._next_k, k + 1)
        elif op == "commit":
            e = self._ents[int(r["k"])]
            c = array("Q")
            c.frombytes(bytes(r["c"]))
            e.commit = CommitInfo(int(r["z"]), int(r["h"]), int(r["t"]), int(r["m"]), c.tolist())
            e.mtime_ns, e.mode = e.commit.mtime_ns, e.commit.mode
        elif op == "unlink" or op == "rmdir":
            parent = self._dir(int(r["p"]))
            k = parent.children.pop(bytes(r["n"]))  # type: ignore[union-attr]
            self._forget(k)
        elif op == "rename":
            self._do_rename(int(r["p"]), bytes(r["n"]), int(r["q"]), bytes(r["w"]))
        elif op == "attr":
            e = self._ents[int(r["k"])]
            if r.get("m") is not None:
                e.mode = int(r["m"])
            if r.get("t") is not None:
                e.mtime_ns = int(r["t"])
            self._attrs_to_commit(e)
        else:
            raise ValueError(f"unknown operation {op!r}")

    def _load_sizes(self) -> None:
        for e in self._ents.values():
            if e.kind == KIND_FILE:
                try:
                    e.size = os.stat(self._data_path(e.k)).st_size
                except FileNotFoundError:
                    e.size = 0
                if e.commit is None or e.size != e.commit.size:
                    e.dirty = True
                self.used_bytes += e.size

    def _collect_garbage(self) -> None:
        live = {f"{k:016x}" for k, e in self._ents.items() if e.kind == KIND_FILE}
        for name in os.listdir(self.data_dir):
            if name not in live:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.data_dir, name))

    # ------------------------------------------------------------ helpers

    def _data_path(self, k: int) -> str:
        return os.path.join(self.data_dir, f"{k:016x}")

    def _dir(self, k: int) -> _Ent:
        e = self._ents.get(k)
        if e is None:
            raise NotFound(f"written entry {k} not found")
        if e.kind != KIND_DIR:
            raise NotADirectory(f"{self._path_of(e)!r} is not a directory")
        return e

    def _path_of(self, e: _Ent) -> bytes:
        parts = []
        while e.k != 0:
            parts.append(e.name)
            e = self._ents[e.parent]
        return b"/".join(reversed(parts))

    def _walk(self, parts: list[bytes]) -> _Ent:
        e = self._ents[0]
        for p in parts:
            if e.kind != KIND_DIR:
                raise NotADirectory(f"{p!r}: a path component is not a directory")
            k = e.children.get(p)  # type: ignore[union-attr]
            if k is None:
                raise NotFound(f"{b'/'.join(parts)!r} not found")
            e = self._ents[k]
        return e

    def _entry(self, path: PathLike) -> _Ent:
        return self._walk(split_path(path))

    def _parent_and_name(self, path: PathLike) -> tuple[_Ent, bytes]:
        parts = split_path(path)
        if not parts:
            raise Exists("the root exists")
        name = parts[-1]
        if len(name) > 255:
            err = FanstoreError(f"name too long ({len(name)} bytes)")
            err.errno = errno.ENAMETOOLONG
            raise err
        parent = self._walk(parts[:-1])
        if parent.kind != KIND_DIR:
            raise NotADirectory(f"{b'/'.join(parts[:-1])!r} is not a directory")
        return parent, name

    def _forget(self, k: int) -> None:
        e = self._ents.pop(k)
        if e.kind == KIND_DIR:
            for c in list(e.children.values()):  # type: ignore[union-attr]
                self._forget(c)
            return
        e.unlinked = True
        if e.nopen == 0:
            self._remove_data(e)
        else:
            self._open_unlinked[k] = e

    def _remove_data(self, e: _Ent) -> None:
        self.used_bytes -= e.size
        if not self.readonly:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._data_path(e.k))

    def _log(self, rec: dict[str, Any], sync: bool) -> None:
        if self.readonly:
            raise FanstoreError("this write store is open read-only")
        self.journal.append(rec, sync)

    def _check_quota(self, growth: int) -> None:
        if growth > 0 and self.quota_bytes is not None and self.used_bytes + growth > self.quota_bytes:
            self.stats.edquot += 1
            raise QuotaExceeded(
                f"write quota of {self.quota_bytes} bytes exceeded "
                f"({self.used_bytes} used, {growth} more requested)"
            )

    def _record(self, e: _Ent) -> Record:
        if e.kind == KIND_DIR:
            nsub = sum(1 for c in e.children.values() if self._ents[c].kind == KIND_DIR)  # type: ignore
            return Record(WRITE_INODE_BASE + e.k - 1, e.name, KIND_DIR, e.mode, e.uid, e.gid,
                          e.mtime_ns, _DIR_SIZE, 0, len(e.children), 2 + nsub)  # type: ignore[arg-type]
        return Record(WRITE_INODE_BASE + e.k - 1, e.name, KIND_FILE, e.mode, e.uid, e.gid,
                      e.mtime_ns, e.size, 0, 0, 0 if e.unlinked else 1)

    def _handle(self, fh: int) -> _Handle:
        h = self._handles.get(fh)
        if h is None:
            raise BadHandle(f"file handle {fh} is not open")
        return h

    # ------------------------------------------------------------ inodes

    @staticmethod
    def is_write_inode(inode: int) -> bool:
        return inode > WRITE_INODE_BASE

    def inode(self, path: PathLike) -> int:
        """The inode of a written path (the written root, b"", answers WRITE_INODE_BASE)."""
        with self._lock:
            return WRITE_INODE_BASE + self._entry(path).k

    def handle_path(self, fh: int) -> bytes | None:
        """Path of the file behind an open handle (None once it was unlinked)."""
        with self._lock:
            e = self._ents.get(self._handle(fh).k)
            if e is None or e.unlinked:
                return None
            return self._path_of(e)

    def path(self, inode: int) -> bytes:
        """Mount-relative path of a written inode (NotFound once it is gone)."""
        with self._lock:
            e = self._ents.get(inode - WRITE_INODE_BASE)
            if e is None:
                raise NotFound(f"written inode {inode} is gone")
            return self._path_of(e)

    # ------------------------------------------------------------ namespace

    def exists(self, path: PathLike) -> bool:
        with self._lock:
            try:
                self._entry(path)
                return True
            except (NotFound, NotADirectory):
                return False

    def getattr(self, path: PathLike) -> Record:
        with self._lock:
            return self._record(self._entry(path))

    def lookup(self, parent: PathLike, name: bytes) -> Record:
        with self._lock:
            d = self._entry(parent)
            if d.kind != KIND_DIR:
                raise NotADirectory(f"{parent!r} is not a directory")
            k = d.children.get(name)  # type: ignore[union-attr]
            if k is None:
                raise NotFound(f"{name!r} not found")
            return self._record(self._ents[k])

    def listdir(self, path: PathLike) -> list[Record]:
        """Children sorted by name (the FUSE layer merges them with dataset children)."""
        with self._lock:
            d = self._entry(path)
            if d.kind != KIND_DIR:
                raise NotADirectory(f"{path!r} is not a directory")
            return [self._record(self._ents[d.children[n]]) for n in sorted(d.children)]  # type: ignore

    def _new_entry(self, path: PathLike, kind_bits: int, mode: int, uid: int | None,
                   gid: int | None) -> tuple[_Ent, bytes, int, int, int, int, int]:
        """Parent, name, new id, time, mode, uid, gid for a name that must not exist yet."""
        parent, name = self._parent_and_name(path)
        if name in parent.children:  # type: ignore[operator]
            raise Exists(f"{path!r} exists")
        u = self._uid if uid is None else uid
        g = self._gid if gid is None else gid
        return parent, name, self._next_k, time.time_ns(), kind_bits | (mode & 0o7777), u, g

    def mkdir(self, path: PathLike, mode: int = 0o755, shadow: bool = False,
              uid: int | None = None, gid: int | None = None) -> Record:
        with self._lock:
            parent, name, k, now, m, u, g = self._new_entry(path, stat.S_IFDIR, mode, uid, gid)
            self._log({"o": "mkdir", "k": k, "p": parent.k, "n": name, "m": m, "u": u, "g": g,
                       "t": now, "s": shadow}, sync=True)
            self._next_k += 1
            e = _Ent(k, parent.k, name, KIND_DIR, m, u, g, now, _DIR_SIZE, {}, shadow)
            self._ents[k] = e
            parent.children[name] = k  # type: ignore[index]
            parent.mtime_ns = now
            return self._record(e)

    def makedirs_shadow(self, path: PathLike) -> None:
        """Make sure every directory of `path` exists here, as shadows of dataset directories.

        The FUSE layer calls this before a create/mkdir inside a dataset directory; shadow
        directories are structure only (stage-out recreates them; they are not written dirs).
        """
        with self._lock:
            parts = split_path(path)
            for i in range(1, len(parts) + 1):
                try:
                    e = self._walk(parts[:i])
                except NotFound:
                    self.mkdir(b"/".join(parts[:i]), 0o755, shadow=True)
                    continue
                if e.kind != KIND_DIR:
                    raise NotADirectory(f"{b'/'.join(parts[:i])!r} is not a directory")

    def rmdir(self, path: PathLike) -> None:
        with self._lock:
            parent, name = self._parent_and_name(path)
            k = parent.children.get(name)  # type: ignore[union-attr]
            if k is None:
                raise NotFound(f"{path!r} not found")
            e = self._ents[k]
            if e.kind != KIND_DIR:
                raise NotADirectory(f"{path!r} is not a directory")
            if e.children:
                raise NotEmpty(f"{path!r} is not empty")
            self._log({"o": "rmdir", "p": parent.k, "n": name}, sync=True)
            del parent.children[name]  # type: ignore[union-attr]
            self._forget(k)
            parent.mtime_ns = time.time_ns()

    def unlink(self, path: PathLike) -> None:
        with self._lock:
            parent, name = self._parent_and_name(path)
            k = parent.children.get(name)  # type: ignore[union-attr]
            if k is None:
                raise NotFound(f"{path!r} not found")
            if self._ents[k].kind == KIND_DIR:
                raise IsADirectory(f"{path!r} is a directory")
            self._log({"o": "unlink", "p": parent.k, "n": name}, sync=True)
            del parent.children[name]  # type: ignore[union-attr]
            self._forget(k)
            parent.mtime_ns = time.time_ns()

    def rename(self, old: PathLike, new: PathLike, noreplace: bool = False) -> None:
        """POSIX rename(2) within the written namespace (RENAME_NOREPLACE via `noreplace`)."""
        with self._lock:
            op, on = self._parent_and_name(old)
            np_, nn = self._parent_and_name(new)
            if on not in op.children:  # type: ignore[operator]
                raise NotFound(f"{old!r} not found")
            if noreplace and nn in np_.children:  # type: ignore[operator]
                raise Exists(f"{new!r} exists")
            self._check_rename(op, on, np_, nn)
            self._log({"o": "rename", "p": op.k, "n": on, "q": np_.k, "w": nn}, sync=True)
            self._do_rename(op.k, on, np_.k, nn)

    def _check_rename(self, op: _Ent, on: bytes, np_: _Ent, nn: bytes) -> None:
        src = self._ents[op.children[on]]  # type: ignore[index]
        if src.kind == KIND_DIR:
            a = np_
            while True:  # the new parent must not be the source or inside it
                if a.k == src.k:
                    raise InvalidArgument("cannot move a directory into itself")
                if a.k == 0:
                    break
                a = self._ents[a.parent]
        tk = np_.children.get(nn)  # type: ignore[union-attr]
        if tk is None or tk == src.k:
            return
        dst = self._ents[tk]
        if src.kind == KIND_DIR and dst.kind != KIND_DIR:
            raise NotADirectory("cannot replace a file with a directory")
        if src.kind != KIND_DIR and dst.kind == KIND_DIR:
            raise IsADirectory("cannot replace a directory with a file")
        if dst.kind == KIND_DIR and dst.children:
            raise NotEmpty("target directory is not empty")

    def _do_rename(self, opk: int, on: bytes, npk: int, nn: bytes) -> None:
        op, np_ = self._dir(opk), self._dir(npk)
        self._check_rename(op, on, np_, nn)
        k = op.children[on]  # type: ignore[index]
        tk = np_.children.get(nn)  # type: ignore[union-attr]
        if tk == k:
            return
        if tk is not None:
            self._forget(tk)
        del op.children[on]  # type: ignore[union-attr]
        np_.children[nn] = k  # type: ignore[index]
        e = self._ents[k]
        e.parent, e.name = np_.k, nn
        now = time.time_ns()
        op.mtime_ns = np_.mtime_ns = now

    @staticmethod
    def _attrs_to_commit(e: _Ent) -> None:
        """chmod/utimens apply to the committed version too (what peers and stage-out see)."""
        if e.commit is not None:
            e.commit = CommitInfo(e.commit.size, e.commit.xxh3, e.mtime_ns, e.mode, e.commit.chunks)

    def chmod(self, path: PathLike, mode: int) -> Record:
        with self._lock:
            e = self._entry(path)
            m = stat.S_IFMT(e.mode) | (mode & 0o7777)
            self._log({"o": "attr", "k": e.k, "m": m, "t": None}, sync=False)
            e.mode = m
            self._attrs_to_commit(e)
            return self._record(e)

    def utimens(self, path: PathLike, mtime_ns: int) -> Record:
        with self._lock:
            e = self._entry(path)
            self._log({"o": "attr", "k": e.k, "m": None, "t": int(mtime_ns)}, sync=False)
            e.mtime_ns = int(mtime_ns)
            self._attrs_to_commit(e)
            return self._record(e)

    # ------------------------------------------------------------ files

    def create(self, path: PathLike, mode: int = 0o644, flags: int = os.O_WRONLY,
               uid: int | None = None, gid: int | None = None) -> tuple[int, Record]:
        """Create and open a new file (O_EXCL semantics: EEXIST if the name exists)."""
        with self._lock:
            parent, name, k, now, m, u, g = self._new_entry(path, stat.S_IFREG, mode, uid, gid)
            try:
                fd = os.open(self._data_path(k), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            except OSError as e:
                raise _os_error(e, f"create {path!r}") from None
            try:
                self._log({"o": "create", "k": k, "p": parent.k, "n": name, "m": m, "u": u,
                           "g": g, "t": now}, sync=False)
            except FanstoreError:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(self._data_path(k))
                raise
            self._next_k += 1
            ent = _Ent(k, parent.k, name, KIND_FILE, m, u, g, now, dirty=True, fd=fd,
                       hasher=_Hasher())
            self._ents[k] = ent
            parent.children[name] = k  # type: ignore[index]
            parent.mtime_ns = now
            fh = self._new_handle(ent, flags | os.O_CREAT)
            self._handles[fh].changed = True  # a new file is committed on close even if empty
            return fh, self._record(ent)

    def _new_handle(self, e: _Ent, flags: int) -> int:
        acc = flags & os.O_ACCMODE
        h = _Handle(e.k, acc in (os.O_RDONLY, os.O_RDWR), acc in (os.O_WRONLY, os.O_RDWR),
                    bool(flags & os.O_APPEND))
        if e.fd < 0:
            try:
                e.fd = os.open(self._data_path(e.k), os.O_RDWR if not self.readonly else os.O_RDONLY)
            except OSError as err:
                raise _os_error(err, f"open {self._path_of(e)!r}") from None
        e.nopen += 1
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = h
        return fh

    def open(self, path: PathLike, flags: int = os.O_RDONLY) -> int:
        """Open a written file; O_TRUNC truncates. Returns a handle for read/write/close."""
        with self._lock:
            e = self._entry(path)
            if e.kind == KIND_DIR:
                if flags & os.O_ACCMODE != os.O_RDONLY:
                    raise IsADirectory(f"{path!r} is a directory")
                raise IsADirectory(f"{path!r} is a directory (use listdir)")
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
            end = off + n
            self._check_quota(end - e.size)
            try:
                written = os.pwrite(e.fd, data, off)
            except OSError as err:
                if err.errno == errno.ENOSPC:
                    self.stats.enospc += 1
                # A partial write may have grown the file: keep size/accounting honest.
                self._resync_size(e)
                raise _os_error(err, f"write {self._path_of(e)!r}") from None
            h.changed = True
            e.dirty = True
            self.stats.bytes_written += written
            if e.hasher is not None:
                if off == e.hasher.pos and off == e.size and written == n:
                    e.hasher.update(data)
                else:
                    e.hasher = None
            new_end = off + written
            if new_end > e.size:
                self.used_bytes += new_end - e.size
                e.size = new_end
            e.mtime_ns = time.time_ns()
            return written

    def _resync_size(self, e: _Ent) -> None:
        with contextlib.suppress(OSError):
            size = os.fstat(e.fd).st_size
            if size != e.size:
                self.used_bytes += size - e.size
                e.size = size
                e.hasher = None
                e.dirty = True

    def read(self, fh: int, off: int, size: int) -> bytes:
        with self._lock:
            h = self._handle(fh)
            if not h.readable:
                raise BadHandle(f"handle {fh} is not open for reading")
            e = self._file(h)
            if off >= e.size or size <= 0:
                return b""
            try:
                return os.pread(e.fd, min(size, e.size - off), off)
            except OSError as err:
                raise _os_error(err, f"read {self._path_of(e)!r}") from None

    def _file(self, h: _Handle) -> _Ent:
        e = self._ents.get(h.k) or self._open_unlinked.get(h.k)
        if e is None:
            raise BadHandle(f"file {h.k} is gone")
        return e

    def truncate(self, path_or_fh: PathLike | int, size: int) -> Record:
        """ftruncate (an int handle) or truncate (a path)."""
        with self._lock:
            if isinstance(path_or_fh, int):
                h = self._handle(path_or_fh)
                if not h.writable:
                    raise BadHandle(f"handle {path_or_fh} is not open for writing")
                e = self._file(h)
                self._truncate(e, size)
                h.changed = True
                return self._record(e)
            e = self._entry(path_or_fh)
            if e.kind == KIND_DIR:
                raise IsADirectory(f"{path_or_fh!r} is a directory")
            fh = self.open(path_or_fh, os.O_WRONLY)
            try:
                self._truncate(e, size)
                self._handles[fh].changed = True
            finally:
                self.close(fh)
            return self._record(e)

    def _truncate(self, e: _Ent, size: int) -> None:
        if size < 0:
            raise InvalidArgument("negative size")
        self._check_quota(size - e.size)
        try:
            os.ftruncate(e.fd, size)
        except OSError as err:
            raise _os_error(err, f"truncate {self._path_of(e)!r}") from None
        self.used_bytes += size - e.size
        e.size = size
        e.dirty = True
        e.mtime_ns = time.time_ns()
        if size == 0:
            e.hasher = _Hasher()
        elif e.hasher is not None and e.hasher.pos != size:
            e.hasher = None

    def fsync(self, fh: int) -> None:
        """Commit the file now (data fsync'd, size + checksums journaled): visible to peers."""
        with self._lock:
            h = self._handle(fh)
            e = self._file(h)
            if e.unlinked:
                with contextlib.suppress(OSError):
                    os.fsync(e.fd)
            elif e.dirty or e.commit is None:
                self._commit(e)
            h.changed = False

    def flush(self, fh: int) -> None:
        """FUSE flush (every close(2)): commit if this handle changed the file, so a failed
        commit (ENOSPC, EDQUOT) reaches close(2); `close` (release) then only frees the handle."""
        with self._lock:
            h = self._handle(fh)
            e = self._file(h)
            if h.changed and not e.unlinked and (e.dirty or e.commit is None):
                self._commit(e)
            h.changed = False

    def close(self, fh: int) -> None:
        """release(): commit if this handle changed the file; the last close frees the fd."""
        with self._lock:
            h = self._handles.get(fh)
            if h is None:
                raise BadHandle(f"file handle {fh} is not open")
            e = self._file(h)
            unlinked = e.unlinked
            try:
                if h.changed and not unlinked and (e.dirty or e.commit is None):
                    self._commit(e)
            finally:
                del self._handles[fh]
                e.nopen -= 1
                if e.nopen == 0:
                    if e.fd >= 0:
                        os.close(e.fd)
                        e.fd = -1
                    if unlinked:
                        self._open_unlinked.pop(e.k, None)
                        self._remove_data(e)

    def close_all(self) -> list[bytes]:
        """Close every open handle (committing changed files); returns paths that failed."""
        failed: list[bytes] = []
        with self._lock:
            for fh in list(self._handles):
                k = self._handles[fh].k
                try:
                    self.close(fh)
                except FanstoreError as err:
                    e = self._ents.get(k)
                    failed.append(self._path_of(e) if e else b"")
                    log.error("closing %s: %s", e and self._path_of(e), err)
        return failed

    def _commit(self, e: _Ent) -> None:
        try:
            os.fsync(e.fd)
        except OSError as err:
            raise _os_error(err, f"fsync {self._path_of(e)!r}") from None
        if e.hasher is not None and e.hasher.pos == e.size:
            digest, chunks = e.hasher.digest()
        else:
            digest, chunks = hash_file(e.fd, e.size)
            e.hasher = None  # only appends after this can be hashed incrementally again
        if not e.synced_dirent:
            with contextlib.suppress(OSError):
                dfd = os.open(self.data_dir, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
            e.synced_dirent = True
        c = array("Q", chunks)
        self._log({"o": "commit", "k": e.k, "z": e.size, "h": digest, "c": c.tobytes(),
                   "t": e.mtime_ns, "m": e.mode}, sync=True)
        e.commit = CommitInfo(e.size, digest, e.mtime_ns, e.mode, chunks)
        e.dirty = False
        self.stats.commits += 1

    # ------------------------------------------------------------ export (close-to-open)

    def committed(self, path: PathLike) -> Committed:
        """(size, xxh3, mtime_ns, mode) of the last closed/fsync'd version; NotCommitted if none."""
        return self.commit_info(path).public()

    def commit_info(self, path: PathLike) -> CommitInfo:
        with self._lock:
            e = self._entry(path)
            if e.kind == KIND_DIR:
                raise IsADirectory(f"{path!r} is a directory")
            if e.commit is None:
                raise NotCommitted(f"{path!r} has not been closed yet")
            return e.commit

    def read_committed_chunk(self, path: PathLike, index: int) -> bytes:
        """Chunk `index` (CHUNK bytes) of the committed version, verified against its xxh3.

        A file rewritten after its last close fails verification for the changed chunks:
        the caller gets ChecksumError (EIO), never bytes of a different version.
        """
        with self._lock:
            e = self._entry(path)
            c = self.commit_info(path)
            if index < 0 or index * CHUNK >= max(c.size, 1) or index >= len(c.chunks):
                raise InvalidArgument(f"chunk {index} is outside {path!r}")
            n = min(CHUNK, c.size - index * CHUNK)
            fd = e.fd if e.fd >= 0 else os.open(self._data_path(e.k), os.O_RDONLY)
            try:
                data = os.pread(fd, n, index * CHUNK) if n else b""
            except OSError as err:
                raise _os_error(err, f"read {path!r}") from None
            finally:
                if fd != e.fd:
                    os.close(fd)
            if len(data) != n or checksum(data) != c.chunks[index]:
                raise ChecksumError(
                    f"{os.fsdecode(_b(path))}: chunk {index} does not match its committed checksum "
                    "(changed since the last close?)"
                )
            return data

    def read_committed(self, path: PathLike, off: int, size: int) -> bytes:
        """Bytes [off, off+size) of the committed version (clipped to its size), verified."""
        c = self.commit_info(path)
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
        """Every entry below the root, parents first: (path, record, commit, data file)."""
        with self._lock:
            stack = [0]
            out: list[tuple[bytes, Record, CommitInfo | None, str | None]] = []
            while stack:
                d = self._ents[stack.pop()]
                for name in sorted(d.children, reverse=True):  # type: ignore[arg-type]
                    e = self._ents[d.children[name]]  # type: ignore[index]
                    p = self._path_of(e)
                    if e.kind == KIND_DIR:
                        out.append((p, self._record(e), None, None))
                        stack.append(e.k)
                    else:
                        out.append((p, self._record(e), e.commit, self._data_path(e.k)))
        out.sort(key=lambda t: t[0].split(b"/"))
        yield from out

    def is_shadow(self, path: PathLike) -> bool:
        with self._lock:
            return self._entry(path).shadow

    def is_dirty(self, path: PathLike) -> bool:
        """True if the file changed since its last commit (or was never committed)."""
        with self._lock:
            e = self._entry(path)
            return e.kind == KIND_FILE and (e.dirty or e.commit is None)

    def status(self) -> dict[str, int | None]:
        with self._lock:
            files = sum(1 for e in self._ents.values() if e.kind == KIND_FILE)
            return {
                **self.stats.as_dict(),
                "write_used_bytes": self.used_bytes,
                "write_quota_bytes": self.quota_bytes,
                "written_files": files,
                "written_dirs": len(self._ents) - files - 1,
                "open_handles": len(self._handles),
            }

    def close_store(self) -> None:
        """Close handles (committing) and the journal. The data stays for stage-out."""
        if not self.readonly:
            self.close_all()
        with self._lock:
            for e in list(self._ents.values()) + list(self._open_unlinked.values()):
                if e.fd >= 0:
                    os.close(e.fd)
                    e.fd = -1
            self.journal.close()

    def __enter__(self) -> WriteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_store()
