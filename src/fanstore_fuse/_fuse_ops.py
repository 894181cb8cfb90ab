"""The pyfuse3 Operations: a thin translation layer over a `Node`.

Domain errors become `FUSEError(errno)` here and nowhere else (`_translate`).
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar, cast

import pyfuse3
import trio

from ._errors import FanstoreError, NotFound, PeerError, ReadOnly
from ._format import KIND_DIR
from ._namespace import Record
from ._node import Node
from ._shared_writes import REMOTE_INODE_BASE
from ._writes import WRITE_INODE_BASE, Exists

if TYPE_CHECKING:
    from ._shared_writes import Published, SharedWrites
    from ._writes import WriteStore

REMOTE_FH = 1 << 61  # handles of files written on other ranks

log = logging.getLogger("fanstore_fuse.fuse")

ENTRY_TIMEOUT = 3600.0  # the dataset is immutable for the life of the mount
WRITTEN_TIMEOUT = 1.0  # written files change: cache their attributes briefly
WRITE_FH = 1 << 62  # file handles at or above this are WriteStore handles
BIG_WRITE = 64 << 10  # writes and reads of written files above this go to a worker thread
_QUIET = {errno.ENOENT, errno.ENODATA, errno.EROFS, errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR,
          errno.ENOTDIR, errno.EACCES, errno.EPERM}
XATTR_PREFIX = b"user.fanstore."
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Coroutine[Any, Any, Any]])


def _translate(fn: F) -> F:
    """Map domain errors to errnos; no other exception may leave a handler."""

    @functools.wraps(fn)
    async def wrapper(self: Operations, *args: Any) -> T:
        try:
            return await fn(self, *args)
        except pyfuse3.FUSEError:
            raise
        except FanstoreError as e:
            if e.errno not in _QUIET:
                log.error("%s: %s", fn.__name__, e)
            raise pyfuse3.FUSEError(e.errno) from None
        except Exception:
            log.exception("unexpected error in %s", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return cast(F, wrapper)


def _erofs(name: str) -> Callable[..., Coroutine[Any, Any, Any]]:
    async def handler(self: Operations, *args: Any) -> Any:
        raise pyfuse3.FUSEError(errno.EROFS)

    handler.__name__ = name
    return handler


def _is_written(inode: int) -> bool:
    return inode >= WRITE_INODE_BASE


def _is_remote(inode: int) -> bool:
    return inode >= REMOTE_INODE_BASE


def _join(parent: bytes, name: bytes) -> bytes:
    return parent + b"/" + name if parent else name


class Operations(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, node: Node, owner_uid: int | None = None, writes: WriteStore | None = None,
                 shared: SharedWrites | None = None):
        super().__init__()
        self.node = node
        self.writes = writes
        self.shared = shared  # files written on other ranks (multi-rank mounts)
        self._remote_open: dict[int, tuple[Published, dict[int, bytes]]] = {}
        self._next_remote_fh = 0
        self.owner_uid = os.getuid() if owner_uid is None else owner_uid

    # ------------------------------------------------------------ attributes

    def _attr(self, r: Record) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = r.inode
        a.generation = 0
        if _is_remote(r.inode):
            t = 0.0  # written on another rank: revalidate every time (close-to-open)
        elif _is_written(r.inode):
            t = WRITTEN_TIMEOUT
        else:
            t = ENTRY_TIMEOUT
        a.entry_timeout = t
        a.attr_timeout = t
        a.st_mode = r.mode
        a.st_nlink = r.nlink
        a.st_uid = r.uid
        a.st_gid = r.gid
        a.st_rdev = 0
        a.st_size = r.size
        a.st_blksize = 1 << 17
        a.st_blocks = (r.size + 511) // 512
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = r.mtime_ns
        return a

    # ------------------------------------------------------------ dataset or written?

    def _w(self) -> WriteStore:
        if self.writes is None:
            raise ReadOnly("this mount is read-only")
        return self.writes

    async def _record_at(self, path: bytes) -> Record:
        """The entry at a mount-relative path: the dataset's, else a written one."""
        try:
            return await self.node.record(self.node.ns.resolve(path))
        except NotFound:
            pass
        try:
            return self._w().getattr(path)
        except NotFound:
            if self.shared is None:
                raise
            return self.shared.record(await self.shared.stat(path))

    async def _dir_path(self, inode: int) -> bytes:
        if _is_remote(inode):
            return self._remote_path(inode)
        if _is_written(inode):
            return self._w().path(inode)
        rec = await self.node.record(inode - 1)
        if not rec.is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return self.node.ns.path(inode - 1)

    def _in_dataset(self, parent_inode: int, name: bytes) -> bool:
        if _is_written(parent_inode):
            return False
        try:
            self.node.ns.lookup(parent_inode - 1, name)
            return True
        except NotFound:
            return False

    def _remote_path(self, inode: int) -> bytes:
        if self.shared is None:
            raise NotFound(f"inode {inode} unknown")
        return self.shared.path(inode)

    async def _written_lookup(self, ppath: bytes, name: bytes) -> Record:
        """A written entry: this rank's own, else one published by another rank."""
        if self.writes is not None:
            try:
                return self.writes.lookup(ppath, name)
            except NotFound:
                pass
        if self.shared is None:
            raise NotFound(f"{name!r} not found")
        return self.shared.record(await self.shared.stat(_join(ppath, name)))

    @_translate
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext):
        if _is_written(parent_inode):
            path = await self._dir_path(parent_inode)
            if name == b"..":
                return self._attr(await self._record_at(path.rpartition(b"/")[0]))
            if name == b".":
                return self._attr(await self._record_at(path))
            return self._attr(await self._written_lookup(path, name))
        try:
            return self._attr(await self.node.lookup(parent_inode - 1, name))
        except NotFound:
            if self.writes is None and self.shared is None:
                raise
            return self._attr(await self._written_lookup(self.node.ns.path(parent_inode - 1), name))

    @_translate
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext | None = None):
        if _is_remote(inode):
            assert self.shared is not None
            return self._attr(self.shared.record(await self.shared.stat(self._remote_path(inode))))
        if _is_written(inode):
            w = self._w()
            return self._attr(w.getattr(w.path(inode)))
        return self._attr(await self.node.record(inode - 1))

    async def forget(self, inode_list) -> None:
        return None  # dataset inodes are static

    @_translate
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        return await self.node.readlink(inode - 1)

    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        return True  # the kernel checks permissions (default_permissions)

    # ------------------------------------------------------------ directories

    @_translate
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        await self._dir_path(inode)
        return inode

    async def _written_children(self, path: bytes, parent_inode: int) -> list[Record]:
        out: list[Record] = []
        if self.writes is not None:
            try:
                out = [r for r in self.writes.listdir(path)
                       if not self.writes.is_shadow(_join(path, r.name))]
            except FanstoreError:
                out = []
        if self.shared is not None:
            seen = {r.name for r in out}
            try:
                remote = await self.shared.listdir(path)
            except PeerError as e:  # a silent owner must not break listing the dataset
                log.warning("listing %r without files written elsewhere: %s", path, e)
                remote = []
            for ent in remote:
                r = self.shared.record(ent)
                if r.name not in seen and ent.writer != self.shared.rank:
                    out.append(r)
        out = [r for r in out if not self._in_dataset(parent_inode, r.name)]
        out.sort(key=lambda r: r.name)
        return out

    @_translate
    async def readdir(self, fh: int, start_id: int, token) -> None:
        pos = start_id
        if _is_written(fh):
            n_ds = 0
        else:
            index = fh - 1
            n_ds = self.node.ns.m.entries["count"][index]
            batch = 256
            while pos < n_ds:
                recs = await self.node.listdir(index, pos, batch)
                for r in recs:
                    pos += 1
                    if not pyfuse3.readdir_reply(token, r.name, self._attr(r), pos):
                        return
                if not recs:
                    break
        if self.writes is None and self.shared is None:
            return
        extra = await self._written_children(await self._dir_path(fh), fh)
        for r in extra[pos - n_ds :]:
            pos += 1
            if not pyfuse3.readdir_reply(token, r.name, self._attr(r), pos):
                return

    async def releasedir(self, fh: int) -> None:
        return None

    # ------------------------------------------------------------ files

    @_translate
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext):
        if _is_remote(inode):
            if flags & _WRITE_FLAGS:
                raise pyfuse3.FUSEError(errno.EPERM)  # only the writing node may change it
            assert self.shared is not None
            e = await self.shared.stat(self._remote_path(inode))  # close-to-open: fresh state
            self._next_remote_fh += 1
            fh = REMOTE_FH + self._next_remote_fh
            self._remote_open[fh] = (e, {})
            return pyfuse3.FileInfo(fh=fh, keep_cache=False)
        if _is_written(inode):
            w = self._w()
            fh = await trio.to_thread.run_sync(w.open, w.path(inode), flags)
            return pyfuse3.FileInfo(fh=WRITE_FH + fh, keep_cache=False)
        if flags & _WRITE_FLAGS:
            raise pyfuse3.FUSEError(errno.EROFS)
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    @_translate
    async def read(self, fh: int, off: int, size: int) -> bytes:
        if REMOTE_FH <= fh < WRITE_FH:
            e, cache = self._remote_open[fh]
            assert self.shared is not None
            return await self.shared.read(e, off, size, cache)
        if fh >= WRITE_FH:
            return await self._maybe_thread(size, self._w().read, fh - WRITE_FH, off, size)
        try:
            return await self.node.read(fh - 1, off, size)
        except FanstoreError as e:
            log.error("read %s: %s", self.node.path(fh - 1), e)
            raise pyfuse3.FUSEError(e.errno) from None

    async def _maybe_thread(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        if size >= BIG_WRITE:
            return await trio.to_thread.run_sync(fn, *args)
        return fn(*args)

    @_translate
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        if fh < WRITE_FH:
            raise pyfuse3.FUSEError(errno.EROFS)
        return await self._maybe_thread(len(buf), self._w().write, fh - WRITE_FH, off, buf)

    @_translate
    async def flush(self, fh: int) -> None:
        # Answered (not ENOSYS) so that close(2) of a written file commits it, and publishes
        # it to the other ranks, before returning: that is what makes close-to-open
        # visibility hold. A no-op for dataset files. On a --read-only mount ENOSYS tells the
        # kernel to stop sending flush at all: one round trip less per close.
        if self.writes is None and self.shared is None:
            raise pyfuse3.FUSEError(errno.ENOSYS)
        if fh >= WRITE_FH:
            await trio.to_thread.run_sync(self._w().flush, fh - WRITE_FH)
            await self._publish_fh(fh)

    async def _publish_fh(self, fh: int) -> None:
        if self.shared is not None:
            path = self._w().handle_path(fh - WRITE_FH)
            if path is not None:
                await self.shared.publish(path)

    async def _publish(self, path: bytes, exclusive: bool = False) -> None:
        if self.shared is not None:
            await self.shared.publish(path, exclusive)

    @_translate
    async def fsync(self, fh: int, datasync: bool) -> None:
        if fh >= WRITE_FH:
            await trio.to_thread.run_sync(self._w().fsync, fh - WRITE_FH)
            await self._publish_fh(fh)

    @_translate
    async def release(self, fh: int) -> None:
        if REMOTE_FH <= fh < WRITE_FH:
            self._remote_open.pop(fh, None)
        elif fh >= WRITE_FH:
            await trio.to_thread.run_sync(self._w().close, fh - WRITE_FH)

    # ------------------------------------------------------------ the write path

    async def _new_path(self, parent_inode: int, name: bytes) -> bytes:
        """Where a new entry goes; EEXIST over a dataset name; shadow dataset dirs as needed."""
        w = self._w()
        ppath = await self._dir_path(parent_inode)
        if self._in_dataset(parent_inode, name):
            raise Exists(f"{name!r} exists in the dataset")
        if not _is_written(parent_inode) or _is_remote(parent_inode):
            w.makedirs_shadow(ppath)
        path = _join(ppath, name)
        if self.shared is not None:
            try:
                await self.shared.stat(path)
                raise Exists(f"{name!r} was written on another node")
            except NotFound:
                pass
        return path

    @_translate
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext):
        path = await self._new_path(parent_inode, name)
        fh, rec = await trio.to_thread.run_sync(
            self._w().create, path, mode, flags, ctx.uid, ctx.gid
        )
        await self._publish(path, exclusive=True)
        return pyfuse3.FileInfo(fh=WRITE_FH + fh, keep_cache=False), self._attr(rec)

    @_translate
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext):
        path = await self._new_path(parent_inode, name)
        rec = await trio.to_thread.run_sync(self._w().mkdir, path, mode, False, ctx.uid, ctx.gid)
        await self._publish(path, exclusive=True)
        return self._attr(rec)

    async def _written_path(self, parent_inode: int, name: bytes) -> bytes:
        """A path this rank wrote and may change (EROFS: dataset; EPERM: another rank's)."""
        if self._in_dataset(parent_inode, name):
            raise ReadOnly(f"{name!r} belongs to the read-only dataset")
        path = _join(await self._dir_path(parent_inode), name)
        if self.shared is not None and not self._w().exists(path):
            await self.shared.stat(path)  # NotFound if nobody wrote it
            raise pyfuse3.FUSEError(errno.EPERM)
        return path

    @_translate
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        path = await self._written_path(parent_inode, name)
        await trio.to_thread.run_sync(self._w().unlink, path)
        if self.shared is not None:
            await self.shared.unpublish(path)

    @_translate
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        path = await self._written_path(parent_inode, name)
        await trio.to_thread.run_sync(self._w().rmdir, path)
        if self.shared is not None:
            await self.shared.unpublish(path)

    @_translate
    async def rename(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes,
                     flags: int, ctx: pyfuse3.RequestContext) -> None:
        if flags & ~pyfuse3.RENAME_NOREPLACE:
            raise pyfuse3.FUSEError(errno.EINVAL)
        old = await self._written_path(parent_old, name_old)
        if self._in_dataset(parent_new, name_new):
            raise ReadOnly(f"{name_new!r} belongs to the read-only dataset")
        new = await self._new_target(parent_new, name_new)
        noreplace = bool(flags & pyfuse3.RENAME_NOREPLACE)
        w = self._w()
        before = [p for p, *_ in w.walk() if p == old or p.startswith(old + b"/")]
        await trio.to_thread.run_sync(w.rename, old, new, noreplace)
        if self.shared is not None:
            for p in before:
                await self.shared.unpublish(p)
            for p, *_ in w.walk():
                if (p == new or p.startswith(new + b"/")) and not w.is_shadow(p):
                    await self.shared.publish(p)

    async def _new_target(self, parent_inode: int, name: bytes) -> bytes:
        ppath = await self._dir_path(parent_inode)
        if not _is_written(parent_inode) or _is_remote(parent_inode):
            self._w().makedirs_shadow(ppath)
        return _join(ppath, name)

    @_translate
    async def setattr(self, inode: int, attr, fields, fh: int | None, ctx: pyfuse3.RequestContext):
        if _is_remote(inode):
            raise pyfuse3.FUSEError(errno.EPERM)
        if not _is_written(inode):
            raise pyfuse3.FUSEError(errno.EROFS)
        w = self._w()
        path = w.path(inode)
        if fields.update_uid or fields.update_gid:
            raise pyfuse3.FUSEError(errno.EPERM)
        if fields.update_size:
            target = fh - WRITE_FH if fh is not None and fh >= WRITE_FH else path
            await trio.to_thread.run_sync(w.truncate, target, attr.st_size)
        if fields.update_mode:
            w.chmod(path, attr.st_mode)
        if fields.update_mtime:
            w.utimens(path, attr.st_mtime_ns)
        rec = w.getattr(path)
        if self.shared is not None and (rec.kind == KIND_DIR or not w.is_dirty(path)):
            await self.shared.publish(path)
        return self._attr(rec)

    @_translate
    async def statfs(self, ctx: pyfuse3.RequestContext):
        s = pyfuse3.StatvfsData()
        m = self.node.ns.m
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = (m.total_bytes() + 4095) // 4096
        s.f_bfree = s.f_bavail = 0
        if self.writes is not None:
            v = os.statvfs(self.writes.local_dir)
            free = v.f_bavail * v.f_frsize
            if self.writes.quota_bytes is not None:
                free = max(0, min(free, self.writes.quota_bytes - self.writes.used_bytes))
            s.f_bfree = s.f_bavail = free // 4096
            s.f_blocks += s.f_bfree + (self.writes.used_bytes + 4095) // 4096
        s.f_files = m.n_entries
        s.f_ffree = s.f_favail = 0
        s.f_namemax = 255
        return s

    # ------------------------------------------------------------ xattrs

    def _xattrs(self, index: int) -> dict[bytes, bytes]:
        if _is_written(index + 1):
            return {}
        rec = self.node.ns.record(index)
        out: dict[bytes, bytes] = {}
        if rec.kind == 0:
            parts = sorted({self.node.ns.m.partitions[self.node.ns.m.blobs["part"][b]].name
                            for b in self.node.ns.blobs(index)})
            out[XATTR_PREFIX + b"blobs"] = str(rec.count).encode()
            out[XATTR_PREFIX + b"partitions"] = ",".join(parts).encode()
        return out

    def _control_allowed(self, ctx: pyfuse3.RequestContext) -> bool:
        return ctx.uid in (0, self.owner_uid)

    @_translate
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        if inode == pyfuse3.ROOT_INODE and name == XATTR_PREFIX + b"status":
            if not self._control_allowed(ctx):
                raise pyfuse3.FUSEError(errno.EACCES)
            return json.dumps(await self.node.status()).encode()
        value = self._xattrs(inode - 1).get(name)
        if value is None:
            raise pyfuse3.FUSEError(errno.ENODATA)
        return value

    @_translate
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext):
        names = list(self._xattrs(inode - 1))
        if inode == pyfuse3.ROOT_INODE and self._control_allowed(ctx):
            names.append(XATTR_PREFIX + b"status")
        return names

    # Not supported for written entries either: symlinks, hard links, device nodes, xattrs.
    symlink = _erofs("symlink")
    link = _erofs("link")
    mknod = _erofs("mknod")
    setxattr = _erofs("setxattr")
    removexattr = _erofs("removexattr")
