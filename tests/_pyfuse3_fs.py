"""A tiny pyfuse3 file system over a source directory that records the requests it gets.

    python tests/_pyfuse3_fs.py --src SRC --log LOG [--noflush NAME]... [--cache-readdir NAME]...
                                [--no-open] [--readdirplus-auto] MOUNTPOINT

Used by tests/test_pyfuse3_api.py to check the API that scripts/pyfuse3/ adds to pyfuse3 on a
real mount. Files and directories are SRC's (read, written and truncated in place); inodes are
numbered at start (root 1). Every request that matters to those tests is appended to LOG as
one JSON line: {"op": ..., "ino": ..., "fh": ..., ...}, written before the reply, so a record
is in LOG once the system call that caused the request has returned.

- `--noflush NAME`: `open` of the file named NAME returns `FileInfo(noflush=True)`.
- `--cache-readdir NAME`: `opendir` of the directory named NAME (root: `.`) returns
  `FileInfo(cache_readdir=True, keep_cache=True)`; other directories get an integer handle.
- `--no-open`: `open` raises FUSEError(ENOSYS) (the kernel then opens files without OPEN),
  with `inode_fh_without_open = True` and `enable_atomic_o_trunc = False`; file handles are
  then inode numbers.
- `--readdirplus-auto`: `enable_readdirplus_auto = True`; a READDIRPLUS (`token.plus`) is
  answered with one entry, so the kernel asks for the rest with plain READDIR.
"""

from __future__ import annotations

import argparse
import errno
import itertools
import json
import os
import sys

import pyfuse3
import trio

TIMEOUT = 60.0  # entry and attribute timeout (s): no revalidation during a test


class RecordingFs(pyfuse3.Operations):
    def __init__(self, src: str, log: str, noflush: set[str], cache_readdir: set[str],
                 no_open: bool, readdirplus_auto: bool = False) -> None:
        super().__init__()
        self.log = open(log, "a", buffering=1)  # noqa: SIM115 - open for the process's life
        self.noflush = noflush
        self.cache_readdir = cache_readdir
        self.no_open = no_open
        if no_open:
            self.inode_fh_without_open = True
            self.enable_atomic_o_trunc = False
        self.enable_readdirplus_auto = readdirplus_auto
        self.paths: dict[int, str] = {pyfuse3.ROOT_INODE: src}
        self.children: dict[int, dict[bytes, int]] = {}
        self._scan(pyfuse3.ROOT_INODE, itertools.count(pyfuse3.ROOT_INODE + 1))
        self.handles: dict[int, int] = {}  # open file handle -> inode
        self.next_fh = itertools.count(1)

    def _scan(self, ino: int, numbers: itertools.count[int]) -> None:
        entries: dict[bytes, int] = {}
        for name in sorted(os.listdir(self.paths[ino])):
            child = next(numbers)
            self.paths[child] = os.path.join(self.paths[ino], name)
            entries[os.fsencode(name)] = child
            if os.path.isdir(self.paths[child]):
                self._scan(child, numbers)
        self.children[ino] = entries

    def record(self, op: str, **fields: object) -> None:
        self.log.write(json.dumps({"op": op, **fields}) + "\n")

    def _name(self, ino: int) -> str:
        return "." if ino == pyfuse3.ROOT_INODE else os.path.basename(self.paths[ino])

    def _inode_of(self, fh: int) -> int:
        ino = fh if self.no_open else self.handles.get(fh, 0)
        if ino not in self.paths or ino in self.children:
            raise pyfuse3.FUSEError(errno.EBADF)
        return ino

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext | None = None):
        try:
            st = os.lstat(self.paths[inode])
        except KeyError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode
        a.st_mode = st.st_mode
        a.st_nlink = st.st_nlink
        a.st_uid = st.st_uid
        a.st_gid = st.st_gid
        a.st_size = st.st_size
        a.st_blksize = 4096
        a.st_blocks = (st.st_size + 511) // 512
        a.st_atime_ns = st.st_atime_ns
        a.st_mtime_ns = st.st_mtime_ns
        a.st_ctime_ns = st.st_ctime_ns
        a.entry_timeout = TIMEOUT
        a.attr_timeout = TIMEOUT
        return a

    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext):
        child = self.children.get(parent_inode, {}).get(name)
        if child is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        self.record("lookup", ino=child)
        return await self.getattr(child)

    async def forget(self, inode_list) -> None:
        pass

    async def setattr(self, inode: int, attr, fields, fh, ctx):
        self.record("setattr", ino=inode, fh=fh, update_size=fields.update_size,
                    size=attr.st_size if fields.update_size else None)
        if fields.update_size:
            os.truncate(self.paths[inode], attr.st_size)
        return await self.getattr(inode)

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext):
        if inode not in self.children:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        cached = self._name(inode) in self.cache_readdir
        self.record("opendir", ino=inode, cache_readdir=cached)
        if cached:
            return pyfuse3.FileInfo(fh=inode, cache_readdir=True, keep_cache=True)
        return inode

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        plus = getattr(token, "plus", True)
        self.record("readdir", ino=fh, start=start_id, plus=plus)
        entries = list(self.children[fh].items())
        for i in range(start_id, len(entries)):
            name, child = entries[i]
            if not pyfuse3.readdir_reply(token, name, await self.getattr(child), i + 1):
                break
            if plus and self.enable_readdirplus_auto:
                break  # one entry with attributes; the kernel asks for the rest plainly

    async def releasedir(self, fh: int) -> None:
        pass

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext):
        self.record("open", ino=inode, flags=flags)
        if self.no_open:
            raise pyfuse3.FUSEError(errno.ENOSYS)
        fh = next(self.next_fh)
        self.handles[fh] = inode
        noflush = self._name(inode) in self.noflush
        return pyfuse3.FileInfo(fh=fh, keep_cache=False, noflush=noflush)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        ino = self._inode_of(fh)
        self.record("read", ino=ino, fh=fh, off=off, size=size)
        with open(self.paths[ino], "rb") as f:
            return os.pread(f.fileno(), size, off)

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        ino = self._inode_of(fh)
        self.record("write", ino=ino, fh=fh, off=off, size=len(buf))
        with open(self.paths[ino], "r+b") as f:
            return os.pwrite(f.fileno(), buf, off)

    async def flush(self, fh: int) -> None:
        self.record("flush", ino=self._inode_of(fh), fh=fh)

    async def fsync(self, fh: int, datasync: bool) -> None:
        self.record("fsync", ino=self._inode_of(fh), fh=fh)

    async def release(self, fh: int) -> None:
        ino = self._inode_of(fh)
        self.record("release", ino=ino, fh=fh)
        self.handles.pop(fh, None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--noflush", action="append", default=[])
    p.add_argument("--cache-readdir", action="append", default=[])
    p.add_argument("--no-open", action="store_true")
    p.add_argument("--readdirplus-auto", action="store_true")
    p.add_argument("mountpoint")
    a = p.parse_args(argv)
    fs = RecordingFs(a.src, a.log, set(a.noflush), set(a.cache_readdir), a.no_open,
                     a.readdirplus_auto)
    options = set(pyfuse3.default_options) | {"fsname=pyfuse3_api_test"}
    pyfuse3.init(fs, a.mountpoint, options)
    fd = pyfuse3.get_session_fd()
    fs.record("session", device=os.readlink(f"/proc/self/fd/{fd}"))
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=True)
        try:
            pyfuse3.get_session_fd()
            fs.record("session_after_close", raised=False)
        except RuntimeError:
            fs.record("session_after_close", raised=True)
        fs.log.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
