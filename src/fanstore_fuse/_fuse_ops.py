"""The pyfuse3 Operations: a thin translation layer over a `Node`.

Domain errors become `FUSEError(errno)` here and nowhere else (`_translate`).
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pyfuse3

from ._errors import FanstoreError
from ._namespace import Record
from ._node import Node

log = logging.getLogger("fanstore_fuse.fuse")

ENTRY_TIMEOUT = 3600.0  # the dataset is immutable for the life of the mount
XATTR_PREFIX = b"user.fanstore."
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT

T = TypeVar("T")


def _translate(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Map domain errors to errnos; no other exception may leave a handler."""

    @functools.wraps(fn)
    async def wrapper(self: Operations, *args: Any) -> T:
        try:
            return await fn(self, *args)
        except pyfuse3.FUSEError:
            raise
        except FanstoreError as e:
            if e.errno not in (errno.ENOENT, errno.ENODATA, errno.EROFS):
                log.error("%s: %s", fn.__name__, e)
            raise pyfuse3.FUSEError(e.errno) from None
        except Exception:
            log.exception("unexpected error in %s", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


def _erofs(name: str) -> Callable[..., Awaitable[Any]]:
    async def handler(self: Operations, *args: Any) -> Any:
        raise pyfuse3.FUSEError(errno.EROFS)

    handler.__name__ = name
    return handler


class Operations(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, node: Node, owner_uid: int | None = None):
        super().__init__()
        self.node = node
        self.owner_uid = os.getuid() if owner_uid is None else owner_uid

    # ------------------------------------------------------------ attributes

    def _attr(self, r: Record) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = r.inode
        a.generation = 0
        a.entry_timeout = ENTRY_TIMEOUT
        a.attr_timeout = ENTRY_TIMEOUT
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

    @_translate
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext):
        return self._attr(await self.node.lookup(parent_inode - 1, name))

    @_translate
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext | None = None):
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
        rec = await self.node.record(inode - 1)
        if not rec.is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    @_translate
    async def readdir(self, fh: int, start_id: int, token) -> None:
        index = fh - 1
        batch = 256
        pos = start_id
        while True:
            recs = await self.node.listdir(index, pos, batch)
            for r in recs:
                pos += 1
                if not pyfuse3.readdir_reply(token, r.name, self._attr(r), pos):
                    return
            if len(recs) < batch:
                return

    async def releasedir(self, fh: int) -> None:
        return None

    # ------------------------------------------------------------ files

    @_translate
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext):
        if flags & _WRITE_FLAGS:
            raise pyfuse3.FUSEError(errno.EROFS)
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    @_translate
    async def read(self, fh: int, off: int, size: int) -> bytes:
        try:
            return await self.node.read(fh - 1, off, size)
        except FanstoreError as e:
            log.error("read %s: %s", self.node.path(fh - 1), e)
            raise pyfuse3.FUSEError(e.errno) from None

    async def release(self, fh: int) -> None:
        return None

    @_translate
    async def statfs(self, ctx: pyfuse3.RequestContext):
        s = pyfuse3.StatvfsData()
        m = self.node.ns.m
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = (m.total_bytes() + 4095) // 4096
        s.f_bfree = s.f_bavail = 0
        s.f_files = m.n_entries
        s.f_ffree = s.f_favail = 0
        s.f_namemax = 255
        return s

    # ------------------------------------------------------------ xattrs

    def _xattrs(self, index: int) -> dict[bytes, bytes]:
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

    # ------------------------------------------------------------ the dataset is read-only

    setattr = _erofs("setattr")
    mknod = _erofs("mknod")
    mkdir = _erofs("mkdir")
    unlink = _erofs("unlink")
    rmdir = _erofs("rmdir")
    symlink = _erofs("symlink")
    rename = _erofs("rename")
    link = _erofs("link")
    create = _erofs("create")
    write = _erofs("write")
    setxattr = _erofs("setxattr")
    removexattr = _erofs("removexattr")
