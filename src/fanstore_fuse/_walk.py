"""The source walk of `prep`, straight into manifest columns (compact arrays, no per-entry
objects): breadth-first, each directory's children sorted by name bytes and contiguous.

Memory is ~45 bytes per entry plus its name, and one directory's listing at a time; only
directories keep their source path (files are read later through their parent's path).
"""

from __future__ import annotations

import fnmatch
import logging
import os
import stat
from array import array
from dataclasses import dataclass, field

import xxhash

from ._errors import FanstoreError
from ._format import ENTRY_COLUMNS, HASH_SEED, KIND_DIR, KIND_FILE, KIND_LINK

log = logging.getLogger("fanstore_fuse.prep")
_DROP_BITS = stat.S_ISUID | stat.S_ISGID
PATH_MAX = os.pathconf("/", "PC_PATH_MAX") if hasattr(os, "pathconf") else 4096


def is_broadcast(rel: bytes, globs: list[str]) -> bool:
    if not globs:
        return False
    s = os.fsdecode(rel)
    parts = s.split("/")
    prefixes = ["/".join(parts[: k + 1]) for k in range(len(parts))]
    return any(fnmatch.fnmatchcase(p, g) for g in globs for p in prefixes)


@dataclass
class Listing:
    """Every kept entry of the source tree as manifest columns, plus what packing needs."""

    src: bytes
    chunk: int
    globs: list[str]
    cols: dict[str, array] = field(default_factory=lambda: {k: array(t) for k, t in ENTRY_COLUMNS.items()})
    name_off: array = field(default_factory=lambda: array("Q", [0]))
    names: bytearray = field(default_factory=bytearray)
    links: bytearray = field(default_factory=bytearray)
    bcast: bytearray = field(default_factory=bytearray)  # 1 for a file in the broadcast partition
    dirs: dict[int, bytes] = field(default_factory=dict)  # directory entry -> source path
    skipped: int = 0
    n_blobs: int = 0
    normal_bytes: int = 0  # bytes of files not broadcast
    hasher: xxhash.xxh3_64 = field(default_factory=lambda: xxhash.xxh3_64(seed=HASH_SEED))

    def __len__(self) -> int:
        return len(self.cols["parent"])

    def name(self, i: int) -> bytes:
        return bytes(self.names[self.name_off[i] : self.name_off[i + 1]])

    def source(self, i: int) -> bytes:
        """The source path of entry i (a file or directory)."""
        d = self.dirs.get(i)
        if d is not None:
            return d
        return self.dirs[self.cols["parent"][i]] + b"/" + self.name(i)

    def add(self, parent: int, name: bytes, kind: int, st: os.stat_result, path: bytes,
            link: bytes = b"") -> None:
        i = len(self)
        c = self.cols
        c["parent"].append(parent)
        c["kind"].append(kind)
        c["mode"].append(st.st_mode & ~_DROP_BITS)
        c["uid"].append(st.st_uid)
        c["gid"].append(st.st_gid)
        c["mtime_ns"].append(st.st_mtime_ns)
        rel = path[len(self.src) + 1 :]
        self.hasher.update(rel + b"\0" + repr((kind, st.st_size, st.st_mtime_ns, st.st_mode)).encode())
        if kind == KIND_LINK:
            c["size"].append(len(link))
            c["first"].append(len(self.links))
            c["count"].append(0)
            self.links += link
        elif kind == KIND_FILE:
            nblobs = -(-st.st_size // self.chunk)
            c["size"].append(st.st_size)
            c["first"].append(self.n_blobs)
            c["count"].append(nblobs)
            self.n_blobs += nblobs
        else:
            c["size"].append(st.st_size)
            c["first"].append(0)  # set when the directory is listed
            c["count"].append(0)
            self.dirs[i] = path
        b = kind == KIND_FILE and is_broadcast(rel, self.globs)
        self.bcast.append(b)
        if kind == KIND_FILE and not b:
            self.normal_bytes += st.st_size
        self.names += name
        self.name_off.append(len(self.names))


def walk(src: bytes, chunk: int, globs: list[str], exclude: tuple[int, int] | None = None,
         salt: bytes = b"") -> Listing:
    """Breadth-first walk of `src` into a Listing. Special files and paths of PATH_MAX bytes or
    more are skipped with a warning each; `exclude` is the (st_dev, st_ino) of a directory to
    leave out (DEST inside SRC); `salt` starts the dataset-id hash."""
    st = os.lstat(src)
    if not stat.S_ISDIR(st.st_mode):
        raise FanstoreError(f"source {os.fsdecode(src)!r} is not a directory")
    out = Listing(src, chunk, globs)
    out.hasher.update(salt)
    out.add(0, b"", KIND_DIR, st, src)
    kinds = out.cols["kind"]
    i = 0
    while i < len(out):
        if kinds[i] == KIND_DIR:
            path = out.dirs[i]
            kids = _list(out, path, exclude)
            kids.sort(key=lambda k: k[0])
            out.cols["first"][i], out.cols["count"][i] = len(out), len(kids)
            for name, kind, cst, link in kids:
                out.add(i, name, kind, cst, path + b"/" + name, link)
        i += 1
    return out


def _list(out: Listing, path: bytes, exclude: tuple[int, int] | None
          ) -> list[tuple[bytes, int, os.stat_result, bytes]]:
    kids = []
    with os.scandir(path) as it:
        for de in it:
            if len(de.path) >= PATH_MAX:
                out.skipped += 1
                log.warning("skipping %s...: path longer than PATH_MAX (%d bytes)",
                            os.fsdecode(de.path[:200]), PATH_MAX)
                continue
            cst = de.stat(follow_symlinks=False)
            m = cst.st_mode
            if stat.S_ISDIR(m):
                if exclude == (cst.st_dev, cst.st_ino):
                    log.warning("leaving out %s: it is the output directory", os.fsdecode(de.path))
                    continue
                kids.append((de.name, KIND_DIR, cst, b""))
            elif stat.S_ISREG(m):
                kids.append((de.name, KIND_FILE, cst, b""))
            elif stat.S_ISLNK(m):
                kids.append((de.name, KIND_LINK, cst, os.readlink(de.path)))
            else:
                out.skipped += 1
                log.warning("skipping special file %s", os.fsdecode(de.path))
    return kids
