"""The pyfuse3 Operations: translation between FUSE requests and a `MountView`.

Each handler unpacks a request, calls the view and packs the answer (`EntryAttributes`,
`FileInfo`, `StatvfsData`). Domain errors become `FUSEError(errno)` in `_translate` and
nowhere else; no other exception leaves a handler.

The libfuse features pyfuse3 3.5 does not expose are added by the pyfuse3 patch that
`scripts/install-pyfuse3.sh` applies at install (docs/architecture.md, "pyfuse3"):
`FileInfo(noflush=..., cache_readdir=...)`, an opendir that returns a `FileInfo`,
`Operations.inode_fh_without_open` (requests about files opened without OPEN carry the inode
as handle) and `Operations.enable_readdirplus_auto` with `ReaddirToken.plus` (listings without
attributes, `ListingMode`). `PATCHED` says whether the installed pyfuse3 has them; without them
the mount answers OPEN normally (every open and close costs the daemon a request) and every
listing comes with attributes.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, cast

import pyfuse3

from ._blobcodec import Buffer
from ._errors import FanstoreError, InvalidArgument
from ._namespace import Record
from ._view import MountView

log = logging.getLogger("fanstore_fuse.fuse")

_QUIET = {errno.ENOENT, errno.ENODATA, errno.EROFS, errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR,
          errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.ENOSYS, errno.EINVAL,
          errno.ENOTSUP, errno.ENAMETOOLONG, errno.EXDEV}

F = TypeVar("F", bound=Callable[..., Coroutine[Any, Any, Any]])
FIRST_BATCH = 32  # entries built for the first part of one readdir request (grows if they fit)
FILE_BLKSIZE = 1 << 17
DIR_BLKSIZE = 1 << 20  # glibc's readdir reads st_blksize bytes at a time (up to 1 MiB)


def _translate(fn: F) -> F:
    """Map domain errors to errnos; no other exception may leave a handler."""

    @functools.wraps(fn)
    async def wrapper(self: Operations, *args: Any) -> Any:
        self.view.node.stats.requests += 1
        try:
            return await fn(self, *args)
        except FanstoreError as e:
            if e.errno not in _QUIET:
                log.error("%s: %s", fn.__name__, e)
            raise pyfuse3.FUSEError(e.errno) from None
        except Exception:
            log.exception("unexpected error in %s", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return cast(F, wrapper)


class ListingMode:
    """Whether directory listings come with attributes. With READDIRPLUS_AUTO the kernel asks
    READDIRPLUS for the first part of a listing and plain READDIR for the rest unless a lookup
    happened in the directory meanwhile. An entry listed with attributes costs the kernel an
    inode and the daemon an `EntryAttributes`, which a name-only traversal (`find`, a training
    script's class scan) does not need; an entry listed without costs a LOOKUP when it is
    stat'ed (`ls -l`, `du`, a walk that stats).

    So a listing starts with one entry with attributes (`NAMES`), the kernel lists the rest
    plainly, until files are looked up after a listing: then listings come with attributes
    (`PLUS`), except every PROBE_EVERY-th (`PROBE`), which holds its last file back so that the
    kernel lists it plainly, and its stat shows whether files are still stat'ed after listings.
    Switching from `NAMES` costs one directory's files a LOOKUP each."""

    NAMES, PLUS, PROBE = "names", "plus", "probe"
    PROBE_EVERY = 8

    def __init__(self) -> None:
        self.file_lookups = 0  # LOOKUPs answered with a non-directory
        self.stat = False  # files are stat'ed after listings
        # file_lookups when the last NAMES or PROBE listing began (None: before the first
        # listing, when lookups say nothing about listings)
        self._mark: int | None = None
        self._since_probe = 0
        self._probing = False

    def start(self) -> str:
        """How the READDIRPLUS request that starts a listing is answered."""
        looked_up = self._mark is not None and self.file_lookups != self._mark
        if self.stat and self._probing and not looked_up:
            self.stat = False  # the probe's file was not stat'ed: name-only again
        self._probing = False
        if not self.stat and looked_up:
            self.stat, self._since_probe = True, 0
        if not self.stat:
            self._mark = self.file_lookups
            return self.NAMES
        self._since_probe += 1
        if self._since_probe < self.PROBE_EVERY:
            return self.PLUS
        self._since_probe, self._probing, self._mark = 0, True, self.file_lookups
        return self.PROBE

    def no_probe(self) -> None:
        """The PROBE listing had no file to hold back: probe the next listing instead."""
        self._probing = False
        self._since_probe = self.PROBE_EVERY - 1


def patched(ops: type = pyfuse3.Operations) -> bool:
    """The installed pyfuse3 carries the patch (module docstring): files can be served
    without OPEN, and FileInfo takes noflush and cache_readdir."""
    return hasattr(ops, "inode_fh_without_open")


PATCHED = patched()
# The patch's `ReaddirToken.plus`: listings without attributes (`ListingMode`).
AUTO_PLUS = hasattr(pyfuse3.ReaddirToken, "plus")


class Operations(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False
    # The patched pyfuse3 (module docstring): after OPEN answered ENOSYS (`MountView.no_open`)
    # requests about files the kernel opened without OPEN carry the inode as `fh`, which is
    # what `MountView` expects; and no FUSE_CAP_ATOMIC_O_TRUNC, since without OPEN the kernel
    # would never pass O_TRUNC on (it sends a SETATTR of size 0 instead). An unpatched pyfuse3
    # ignores both, and the daemon answers OPEN there.
    inode_fh_without_open = True
    enable_atomic_o_trunc = False
    # The patched pyfuse3: the kernel asks READDIRPLUS for the first part of a listing and
    # after a lookup in the directory, plain READDIR otherwise (`readdir`).
    enable_readdirplus_auto = True

    def __init__(self, view: MountView):
        super().__init__()
        self.view = view
        self._plain = pyfuse3.EntryAttributes()  # a plain READDIR entry's inode number, mode
        self.listings = ListingMode()

    def _attr(self, r: Record) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = r.inode
        a.generation = 0
        a.entry_timeout = a.attr_timeout = self.view.cache_seconds(r.inode)
        a.st_mode = r.mode
        a.st_nlink = r.nlink
        a.st_uid, a.st_gid = self.view.owner_ids(r)
        a.st_rdev = r.first if stat.S_ISCHR(r.mode) or stat.S_ISBLK(r.mode) else 0
        a.st_size = r.size
        a.st_blksize = DIR_BLKSIZE if r.is_dir else FILE_BLKSIZE
        a.st_blocks = (r.size + 511) // 512
        a.st_mtime_ns = r.mtime_ns
        a.st_atime_ns = r.atime_ns or r.mtime_ns  # written entries keep their own
        a.st_ctime_ns = r.ctime_ns or r.mtime_ns
        return a

    # ------------------------------------------------------------ names and attributes

    @_translate
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext):
        r = await self.view.lookup(parent_inode, name)
        if not r.is_dir:
            self.listings.file_lookups += 1
        return self._attr(r)

    @_translate
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext | None = None):
        return self._attr(await self.view.getattr(inode))

    async def forget(self, inode_list) -> None:
        # inode numbers are stable for the life of the mount; without OPEN, written files
        # keep a store handle per inode until the kernel forgets it (MountView.forget)
        if self.view.no_open:
            await self.view.forget(inode for inode, _ in inode_list)

    @_translate
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        return await self.view.readlink(inode)

    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        return True  # the kernel checks permissions (default_permissions)

    # ------------------------------------------------------------ directories

    @_translate
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> Any:
        fh = await self.view.opendir(inode)
        if PATCHED and await self.view.listing_fixed(inode):
            # the kernel keeps this listing in its page cache and lists the directory from
            # there until an opendir answered without these flags drops it
            return pyfuse3.FileInfo(fh=fh, cache_readdir=True, keep_cache=True)  # type: ignore[call-arg]
        return fh

    @_translate
    async def readdir(self, fh: int, start_id: int, token) -> None:
        if not getattr(token, "plus", True):  # an unpatched pyfuse3 asks READDIRPLUS only
            await self._readdir_plain(fh, start_id, token)
            return
        # A READDIRPLUS after the start: the kernel asks again after a lookup in the directory.
        mode = self.listings.start() if not start_id and AUTO_PLUS else ListingMode.PLUS
        pos = start_id
        more = True
        limit = 1 if mode == ListingMode.NAMES else FIRST_BATCH  # a plus reply holds ~20
        while more:
            batch, more = await self.view.listing(fh, pos, limit)
            if not batch:
                return
            held = None
            if mode == ListingMode.PROBE and not more:
                held = next((r for r in reversed(batch) if not r.is_dir), None)
                if held is None or held is batch[0] and pos == start_id:
                    self.listings.no_probe()
                    held = None
            for r in batch:
                if r is held:
                    return  # the kernel asks for the rest with plain READDIR
                pos += 1
                if not pyfuse3.readdir_reply(token, r.name, self._attr(r), pos):
                    return
            if mode == ListingMode.NAMES:
                return
            limit = min(4 * limit, 1024)

    async def _readdir_plain(self, fh: int, pos: int, token) -> None:
        attr = self._plain  # readdir_reply copies what it needs: inode number and type
        more = True
        limit = 1024
        while more:
            names, inodes, modes, more = await self.view.names(fh, pos, limit)
            if not names:
                return
            for name, ino, mode in zip(names, inodes, modes):
                pos += 1
                attr.st_ino, attr.st_mode = ino, mode
                if not pyfuse3.readdir_reply(token, name, attr, pos):
                    return
            limit = 4096

    async def releasedir(self, fh: int) -> None:
        return None

    # ------------------------------------------------------------ files

    @_translate
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext):
        fh, keep = await self.view.open(inode, flags)
        if PATCHED and self.view.writable and flags & os.O_ACCMODE == os.O_RDONLY:
            # nothing to commit at close: no FLUSH round trip (read-only mounts answer FLUSH
            # with ENOSYS once, which turns it off for good)
            return pyfuse3.FileInfo(fh=fh, keep_cache=keep, noflush=True)  # type: ignore[call-arg]
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep)

    @_translate
    async def read(self, fh: int, off: int, size: int) -> Buffer:
        return await self.view.read(fh, off, size)

    @_translate
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        return await self.view.write(fh, off, buf)

    @_translate
    async def flush(self, fh: int) -> None:
        await self.view.flush(fh)

    @_translate
    async def fsync(self, fh: int, datasync: bool) -> None:
        await self.view.fsync(fh)

    @_translate
    async def release(self, fh: int) -> None:
        await self.view.release(fh)

    # ------------------------------------------------------------ the write path

    @_translate
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext):
        fh, rec = await self.view.create(parent_inode, name, mode, flags, ctx.uid, ctx.gid)
        return pyfuse3.FileInfo(fh=fh, keep_cache=False), self._attr(rec)

    @_translate
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext):
        return self._attr(await self.view.mkdir(parent_inode, name, mode, ctx.uid, ctx.gid))

    @_translate
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self.view.remove(parent_inode, name, is_dir=False)

    @_translate
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self.view.remove(parent_inode, name, is_dir=True)

    @_translate
    async def rename(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes,
                     flags: int, ctx: pyfuse3.RequestContext) -> None:
        if flags & ~pyfuse3.RENAME_NOREPLACE:
            raise InvalidArgument(f"rename flags {flags:#x} are not supported")
        await self.view.rename(parent_old, name_old, parent_new, name_new,
                               bool(flags & pyfuse3.RENAME_NOREPLACE))

    @_translate
    async def setattr(self, inode: int, attr, fields, fh: int | None, ctx: pyfuse3.RequestContext):
        rec = await self.view.setattr(
            inode, fh,
            attr.st_size if fields.update_size else None,
            attr.st_mode if fields.update_mode else None,
            attr.st_mtime_ns if fields.update_mtime else None,
            (attr.st_uid if fields.update_uid else None,
             attr.st_gid if fields.update_gid else None),
            attr.st_atime_ns if fields.update_atime else None,
        )
        return self._attr(rec)

    @_translate
    async def statfs(self, ctx: pyfuse3.RequestContext):
        f = self.view.statfs()
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = f.blocks
        s.f_bfree = s.f_bavail = f.free
        s.f_files = f.files
        s.f_ffree = s.f_favail = f.files_free
        s.f_namemax = 255
        return s

    # ------------------------------------------------------------ xattrs

    @_translate
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        return await self.view.getxattr(inode, name, ctx.uid)

    @_translate
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext):
        return await self.view.listxattr(inode, ctx.uid)

    @_translate
    async def setxattr(self, inode: int, name: bytes, value: bytes,
                       ctx: pyfuse3.RequestContext) -> None:
        await self.view.setxattr(inode, name, value)

    @_translate
    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self.view.setxattr(inode, name, None)

    @_translate
    async def symlink(self, parent_inode: int, name: bytes, target: bytes,
                      ctx: pyfuse3.RequestContext):
        return self._attr(await self.view.symlink(parent_inode, name, target, ctx.uid, ctx.gid))

    @_translate
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: pyfuse3.RequestContext):
        return self._attr(await self.view.mknod(parent_inode, name, mode, rdev, ctx.uid, ctx.gid))

    @_translate
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes,
                   ctx: pyfuse3.RequestContext):
        return self._attr(await self.view.link(inode, new_parent_inode, new_name))
