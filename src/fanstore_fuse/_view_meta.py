"""The mount view's figures and extended attributes: statfs and the xattr calls.

A mixin of `MountView` (which provides `node`, `writes`, `status` and `owner_uid`).
Dataset files carry read-only ``user.fanstore.*`` attributes and the root the owner's
``user.fanstore.status``. Entries written on this node keep ``user.*`` attributes (set, get,
list, remove; journaled, staged out with them), published with the entry (`SharedWrites`), so
other nodes get and list them. Setting attributes: ``system.posix_acl_*``
gives **ENOTSUP** on every entry (so ``cp -p``, ``cp -a`` and ``install -m`` treat ACLs as
unsupported, as on a file system mounted without ACLs), other names EROFS on the dataset,
ENOTSUP on written entries unless ``user.*``, and EPERM on another node's entries.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ._errors import AccessDenied, NoData, NotPermitted, ReadOnly, Unsupported
from ._format import KIND_DIR
from ._node import Node
from ._shared_writes import REMOTE_INODE_BASE, Published, SharedWrites
from .writes import WRITE_INODE_BASE, WriteStore

XATTR_PREFIX = b"user.fanstore."
STATUS_XATTR = XATTR_PREFIX + b"status"
ACL_PREFIX = b"system.posix_acl_"


@dataclass
class FsFigures:
    """statfs in 4 KiB blocks: the dataset's size plus what may still be written here; inodes:
    the dataset's entries, the written ones and as many more as the local disk has free."""

    blocks: int
    free: int
    files: int
    files_free: int


class ViewMeta:
    node: Node
    writes: WriteStore | None
    shared: SharedWrites | None
    owner_uid: int
    status: Callable[[], Awaitable[dict[str, object]]]

    def statfs(self) -> FsFigures:
        blocks = (self.node.dataset_bytes() + 4095) // 4096
        free = files_free = written = 0
        if self.writes is not None:
            v = os.statvfs(self.writes.local_dir)
            room = v.f_bavail * v.f_frsize
            if self.writes.quota_bytes is not None:
                room = max(0, min(room, self.writes.quota_bytes - self.writes.used_bytes))
            free = room // 4096
            blocks += free + (self.writes.used_bytes + 4095) // 4096
            files_free = v.f_favail if v.f_files else 1 << 32  # some file systems count no inodes
            written = len(self.writes.tree.ents) - 1
        return FsFigures(blocks, free, len(self.node.ns) + written + files_free, files_free)

    def _xattrs(self, inode: int) -> dict[bytes, bytes]:
        if inode >= WRITE_INODE_BASE:
            return {}
        rec = self.node.ns.record(inode - 1)
        if rec.kind != 0:
            return {}
        return {XATTR_PREFIX + b"blobs": str(rec.count).encode(),
                XATTR_PREFIX + b"partitions": ",".join(self.node.partitions(inode - 1)).encode()}

    def _control_allowed(self, uid: int) -> bool:
        return uid in (0, self.owner_uid)

    def _written_here(self, inode: int) -> bytes | None:
        """The path of an entry written on this node, None for any other inode."""
        if self.writes is None or not WRITE_INODE_BASE <= inode < REMOTE_INODE_BASE:
            return None
        return self.writes.path(inode)

    async def _written_elsewhere(self, inode: int) -> Published | None:
        """An entry written on another node, as published now (None for any other inode)."""
        if self.shared is None or inode < REMOTE_INODE_BASE:
            return None
        return await self.shared.stat(self.shared.path(inode))

    async def getxattr(self, inode: int, name: bytes, uid: int) -> bytes:
        path = self._written_here(inode)
        if path is not None:
            assert self.writes is not None
            return self.writes.getxattr(path, name)
        e = await self._written_elsewhere(inode)
        if e is not None:
            if name not in e.xattrs:
                raise NoData(f"no attribute {name!r}")
            return e.xattrs[name]
        if inode == 1 and name == STATUS_XATTR:
            if not self._control_allowed(uid):
                raise AccessDenied("the status is for the mount's owner")
            return json.dumps(await self.status()).encode()
        value = self._xattrs(inode).get(name)
        if value is None:
            raise NoData(f"no attribute {name!r}")
        return value

    async def listxattr(self, inode: int, uid: int) -> list[bytes]:
        path = self._written_here(inode)
        if path is not None:
            assert self.writes is not None
            return self.writes.listxattr(path)
        e = await self._written_elsewhere(inode)
        if e is not None:
            return sorted(e.xattrs)
        names = list(self._xattrs(inode))
        if inode == 1 and self._control_allowed(uid):
            names.append(STATUS_XATTR)
        return names

    async def setxattr(self, inode: int, name: bytes, value: bytes | None) -> None:
        """setxattr, and removexattr (`value` None); see the module docstring. Published at
        once, except a file changed since its commit: its commit publishes it."""
        if name.startswith(ACL_PREFIX):
            raise Unsupported("POSIX ACLs are not supported", errno.ENOTSUP)
        if inode < WRITE_INODE_BASE:
            raise ReadOnly("the dataset is read-only")
        path = self._written_here(inode)
        if path is None:
            if self.writes is None and inode < REMOTE_INODE_BASE:
                raise ReadOnly("this mount is read-only")
            raise NotPermitted("only the writing node may change this entry")
        w = self.writes
        assert w is not None
        w.setxattr(path, name, value)
        if self.shared is not None and (w.getattr(path).kind == KIND_DIR or not w.is_dirty(path)):
            await self.shared.publish(path)
