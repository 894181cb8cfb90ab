"""The floor of this stack: a null pyfuse3 file system (trio, one process) that answers LOOKUP,
GETATTR, OPEN, READ and READDIR from memory, for a tree of the same shape (names, sizes) as a
directory on disk: ``python -m bench.nullfs --like SRC MOUNTPOINT [--stats-file F]``.

No pyfuse3 daemon can do less per request: every answer is built before the mount, a READ
returns a slice of one shared pattern (no copy, no disk, no decompression, no checksum). Its
files/s and CPU per file are what fanstore-fuse is compared with in ``python -m bench.smallfile``.

Mounted as fanstore-fuse's default mount is (`fanstore_fuse._daemon`, `_fuse_ops`, `_view`):
options ``pyfuse3.default_options`` + ``default_permissions`` and no ``ro``; entry and attribute
timeouts of 3600 s (the dataset is immutable); ``keep_cache`` on dataset opens; the mount's
read-ahead raised to 1024 KiB (sysfs, root only) and set again after INIT; ``min_tasks=1,
max_tasks=128``; ``st_blksize`` 128 KiB for files, 1 MiB for directories. With the project's
pyfuse3 patch (``pyfuse3.Operations.inode_fh_without_open``): OPEN and FLUSH answer ENOSYS (the
kernel's ``no_open``: no OPEN, FLUSH or RELEASE per file, pages kept) and a READ carries the
inode as its fh; one file is opened by a child process right after the mount, as fanstore-fuse
does, so readers never meet the first ENOSYS. Without the patch OPEN is answered (fh = inode,
keep_cache), FLUSH and RELEASE too (no-ops), like a writable mount's dataset files.

File bytes: byte ``k`` of the file with index ``i`` (its place in the sorted walk of SRC) is
``(k + 31 * i) % 251`` (`expected`), so a reader can check every byte and two files differ.

Counters: ``getxattr(MOUNTPOINT, "user.nullfs.status")`` returns JSON with ``requests`` (every
request pyfuse3 handed to Python since the mount, by operation; the getxattr that reads it is
not counted) and ``cpu_s`` (this process's user+system CPU, `getrusage`). At exit the same JSON
is printed on stdout and written to ``--stats-file``. The process ends on SIGTERM/SIGINT, on
unmount (``fusermount3 -u -z``) or after ``--max-seconds``.
"""

from __future__ import annotations

import argparse
import errno
import functools
import inspect
import json
import os
import resource
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pyfuse3
import trio

ENTRY_TIMEOUT = 3600.0  # fanstore-fuse's dataset entries and attributes (_view.ENTRY_TIMEOUT)
FILE_BLKSIZE = 1 << 17
DIR_BLKSIZE = 1 << 20
READAHEAD_KB = 1024  # fanstore-fuse's MountConfig.readahead_kb
MAX_TASKS = 128  # fanstore-fuse's MountConfig.max_tasks
STATUS_XATTR = b"user.nullfs.status"
PERIOD = 251  # a prime: the pattern's period
PATTERN = bytes(i % PERIOD for i in range(PERIOD + (4 << 20)))  # any READ up to 4 MiB is a slice
PATCHED = hasattr(pyfuse3.Operations, "inode_fh_without_open")


def expected(index: int, size: int, off: int = 0) -> bytes:
    """The bytes [off, off + size) of the file with this index (for a reader's check)."""
    start = (off + 31 * index) % PERIOD
    out = PATTERN[start:start + size]
    while len(out) < size:  # longer than the pattern: (slow, only for checks)
        more = size - len(out)
        s = (off + len(out) + 31 * index) % PERIOD
        out += PATTERN[s:s + more]
    return out


def walk(src: Path) -> list[tuple[str, int]]:
    """Every regular file under src as (relative path, size), sorted: the tree's shape."""
    out = []
    for root, dirs, files in os.walk(src):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(root, f)
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                out.append((os.path.relpath(p, src), st.st_size))
    return out


class Tree:
    """Inodes, names and prebuilt attributes of the tree (root: pyfuse3.ROOT_INODE)."""

    def __init__(self, files: list[tuple[str, int]]):
        root = pyfuse3.ROOT_INODE
        self.attrs: dict[int, pyfuse3.EntryAttributes] = {}
        self.children: dict[int, dict[bytes, int]] = {root: {}}
        self.file_index: dict[int, int] = {}  # inode -> index for `expected`
        self.size: dict[int, int] = {}
        self.uid, self.gid = os.getuid(), os.getgid()
        self.now = time.time_ns()
        self.attrs[root] = self._attr(root, stat.S_IFDIR | 0o755, 0)
        nxt = root + 1
        for index, (rel, size) in enumerate(files):
            parent = root
            parts = os.fsencode(rel).split(b"/")
            for name in parts[:-1]:
                kids = self.children[parent]
                if name not in kids:
                    kids[name] = nxt
                    self.children[nxt] = {}
                    self.attrs[nxt] = self._attr(nxt, stat.S_IFDIR | 0o755, 0)
                    nxt += 1
                parent = kids[name]
            self.children[parent][parts[-1]] = nxt
            self.attrs[nxt] = self._attr(nxt, stat.S_IFREG | 0o644, size)
            self.file_index[nxt] = index
            self.size[nxt] = size
            nxt += 1
        self.listing = {d: sorted(k.items()) for d, k in self.children.items()}

    def _attr(self, inode: int, mode: int, size: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode
        a.generation = 0
        a.entry_timeout = a.attr_timeout = ENTRY_TIMEOUT
        a.st_mode = mode
        a.st_nlink = 2 if stat.S_ISDIR(mode) else 1
        a.st_uid, a.st_gid = self.uid, self.gid
        a.st_size = size
        a.st_blksize = DIR_BLKSIZE if stat.S_ISDIR(mode) else FILE_BLKSIZE
        a.st_blocks = (size + 511) // 512
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = self.now
        return a


def _counted(name: str, fn: Callable, counts: dict[str, int]) -> Callable:
    @functools.wraps(fn)
    async def wrapper(*args, **kw):
        counts[name] = counts.get(name, 0) + 1
        return await fn(*args, **kw)

    return wrapper


class NullOps(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, tree: Tree, no_open: bool):
        super().__init__()
        self.tree = tree
        self.no_open = no_open
        if PATCHED:
            self.inode_fh_without_open = no_open  # READ then carries the inode as fh
        if hasattr(pyfuse3.Operations, "enable_atomic_o_trunc"):
            self.enable_atomic_o_trunc = True
        self.counts: dict[str, int] = {}
        for name, _ in inspect.getmembers(pyfuse3.Operations, inspect.iscoroutinefunction):
            if name != "getxattr":  # the status read itself is not counted
                setattr(self, name, _counted(name, getattr(self, name), self.counts))

    def status(self) -> dict:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return {"pid": os.getpid(), "cpu_s": ru.ru_utime + ru.ru_stime, "no_open": self.no_open,
                "pyfuse3_patched": PATCHED, "files": len(self.tree.size),
                "requests": dict(self.counts), "total_requests": sum(self.counts.values())}

    async def lookup(self, parent_inode, name, ctx=None):
        kids = self.tree.children.get(parent_inode)
        if kids is None:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        if name == b".":
            return self.tree.attrs[parent_inode]
        inode = kids.get(name)
        if inode is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self.tree.attrs[inode]

    async def getattr(self, inode, ctx=None):
        try:
            return self.tree.attrs[inode]
        except KeyError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None

    async def access(self, inode, mode, ctx):
        return True  # the kernel checks permissions (default_permissions)

    async def open(self, inode, flags, ctx):
        if self.no_open:
            raise pyfuse3.FUSEError(errno.ENOSYS)  # the kernel's no_open from now on
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise pyfuse3.FUSEError(errno.EROFS)
        fi = pyfuse3.FileInfo(fh=inode, keep_cache=True)
        if hasattr(fi, "noflush"):  # as a writable mount's read-only opens: no FLUSH at close
            fi.noflush = True
        return fi

    async def read(self, fh, off, size):
        n = self.tree.size.get(fh)
        if n is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        size = max(0, min(size, n - off))
        start = (off + 31 * self.tree.file_index[fh]) % PERIOD
        if start + size <= len(PATTERN):
            return memoryview(PATTERN)[start:start + size]
        return expected(self.tree.file_index[fh], size, off)

    async def flush(self, fh):
        if self.no_open:
            raise pyfuse3.FUSEError(errno.ENOSYS)

    async def release(self, fh):
        return None

    async def opendir(self, inode, ctx):
        if inode not in self.tree.children:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        if hasattr(pyfuse3.FileInfo, "cache_readdir"):  # the listing never changes
            fi = pyfuse3.FileInfo(fh=inode, keep_cache=True)
            fi.cache_readdir = True
            return fi
        return inode

    async def readdir(self, fh, start_id, token):
        entries = self.tree.listing[fh]
        for i in range(start_id, len(entries)):
            name, inode = entries[i]
            if not pyfuse3.readdir_reply(token, name, self.tree.attrs[inode], i + 1):
                return

    async def releasedir(self, fh):
        return None

    async def getxattr(self, inode, name, ctx):
        if inode == pyfuse3.ROOT_INODE and name == STATUS_XATTR:
            return json.dumps(self.status()).encode()
        raise pyfuse3.FUSEError(errno.ENODATA)


def bdi_path(mountpoint: str) -> str | None:
    """/sys/class/bdi/<major:minor>/read_ahead_kb of the mount at `mountpoint`."""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4 and fields[4] == mountpoint:
                    return f"/sys/class/bdi/{fields[2]}/read_ahead_kb"
    except OSError:
        pass
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def set_readahead(path: str | None, kb: int) -> bool:
    if path is None or kb <= 0:
        return False
    try:
        with open(path, "w") as f:
            f.write(str(kb))
    except OSError:
        return False
    return True


async def hold_readahead(path: str | None, kb: int) -> None:
    """The kernel cuts read-ahead back to what INIT's reply allows once the daemon answers
    INIT (after `pyfuse3.init`): wait for that (10 s at most) and set it again, once."""
    if path is None or kb <= 0:
        return
    with trio.move_on_after(10):
        while _read_int(path) == kb:
            await trio.sleep(0.005)
    if _read_int(path) != kb:
        set_readahead(path, kb)


async def prime_no_open(path: str) -> None:
    """Open and close one file from a child process (never this process's own thread: its
    mount would wait on itself), so the kernel takes no_open before a reader comes."""
    code = "import os, sys; os.close(os.open(sys.argv[1], os.O_RDONLY | os.O_NONBLOCK))"
    with trio.move_on_after(30):
        await trio.run_process([sys.executable, "-I", "-S", "-c", code, path], check=False,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)


async def serve(ops: NullOps, mountpoint: str, first_file: str | None, max_seconds: float,
                readahead_kb: int) -> None:
    async with trio.open_nursery() as nursery:
        async def on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
                async for _ in sigs:
                    pyfuse3.terminate()
                    return

        async def lifetime() -> None:
            await trio.sleep(max_seconds)
            print(f"nullfs: --max-seconds {max_seconds:.0f} reached, unmounting",
                  file=sys.stderr, flush=True)
            pyfuse3.terminate()

        nursery.start_soon(on_signal)
        nursery.start_soon(lifetime)
        nursery.start_soon(hold_readahead, bdi_path(mountpoint), readahead_kb)
        if ops.no_open and first_file is not None:
            nursery.start_soon(prime_no_open, first_file)
        await pyfuse3.main(min_tasks=1, max_tasks=MAX_TASKS)
        nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.nullfs", description=__doc__.split("\n")[0])
    ap.add_argument("mountpoint")
    ap.add_argument("--like", required=True, help="a directory whose tree shape is served")
    ap.add_argument("--stats-file", help="where the exit status JSON is written")
    ap.add_argument("--no-open", choices=("auto", "on", "off"), default="auto",
                    help="OPEN answered ENOSYS (auto: when pyfuse3 has the project's patch; "
                         "'on' needs it)")
    ap.add_argument("--readahead-kb", type=int, default=READAHEAD_KB)
    ap.add_argument("--max-seconds", type=float, default=3600.0,
                    help="unmount and exit after this long (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.no_open == "on" and not PATCHED:
        ap.error("--no-open on needs pyfuse3 with Operations.inode_fh_without_open")
    no_open = PATCHED if args.no_open == "auto" else args.no_open == "on"
    files = walk(Path(args.like))
    ops = NullOps(Tree(files), no_open)
    mp = os.path.abspath(args.mountpoint)
    opts = set(pyfuse3.default_options) | {"fsname=nullfs", "subtype=nullfs",
                                           "default_permissions"}
    pyfuse3.init(ops, mp, opts)
    try:
        set_readahead(bdi_path(mp), args.readahead_kb)
        first = os.path.join(mp, files[0][0]) if files else None
        trio.run(serve, ops, mp, first, args.max_seconds, args.readahead_kb)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # a teardown's SIGTERM
            signal.signal(sig, signal.SIG_IGN)  # right after its unmount must not cut this short
        pyfuse3.close(unmount=True)
        out = json.dumps(ops.status())
        print(out, flush=True)
        if args.stats_file:
            tmp = Path(args.stats_file + ".tmp")
            tmp.write_text(out + "\n")
            tmp.replace(args.stats_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
