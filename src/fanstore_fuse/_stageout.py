"""Stage-out: copy every committed written file out of node-local write stores, verified.

Pure library code: no FUSE, no MPI. Each rank stages its own store(s) (in parallel across
ranks); within a rank, `workers` threads copy files. Every file goes to a temporary name in its
destination directory, is checked against the size and xxh3-64 recorded when it was last
closed (the bytes read from the local copy, and by default the destination re-read after
fsync), gets its mode, mtime and ``user.*`` attributes, and only then is renamed over the final
name. A file with several names (hard links) is copied once and its other names are hard
links to that copy. Nothing local is ever removed here: the caller removes a local directory
only when the summary is `ok`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import stat
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ._errors import ChecksumError, FanstoreError
from ._format import KIND_DIR, KIND_LINK
from ._fsio import write_all
from ._namespace import Record
from ._safepath import Escape, open_beneath
from .writes import WRITES_DIR, CommitInfo, WriteStore, hash_file

log = logging.getLogger("fanstore_fuse.stageout")

TMP_PREFIX = ".fanstore-tmp."
_tmp_counter = itertools.count()


@dataclass
class StageFailure:
    path: str  # mount-relative
    reason: str
    local: str = ""  # where the bytes still are


@dataclass
class Unclosed:
    path: str
    size: int  # bytes on local disk
    reason: str
    local: str = ""


@dataclass
class StageOutSummary:
    files: int = 0
    bytes: int = 0
    dirs: int = 0
    seconds: float = 0.0
    failures: list[StageFailure] = field(default_factory=list)
    unclosed: list[Unclosed] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def line(self) -> str:
        s = (f"staged out {self.files} files, {self.bytes} bytes, {self.dirs} directories "
             f"in {self.seconds:.2f} s")
        if self.unclosed:
            s += f"; {len(self.unclosed)} unclosed"
        if self.failures:
            s += f"; {len(self.failures)} FAILED (local copies kept)"
        return s

    def as_dict(self) -> dict[str, object]:
        return {
            "files": self.files, "bytes": self.bytes, "dirs": self.dirs, "seconds": self.seconds,
            "ok": self.ok,
            "failures": [f.__dict__ for f in self.failures],
            "unclosed": [u.__dict__ for u in self.unclosed],
            "warnings": list(self.warnings),
        }


class _Mismatch(Exception):
    pass


def _chown(fd_or_path: int | str, owner: tuple[int, int] | None) -> None:
    """Give a staged entry its recorded owner: as root always; otherwise where the OS lets us
    (a user's own files keep their owner anyway)."""
    if owner is None:
        return
    try:
        os.chown(fd_or_path, *owner)
    except PermissionError:
        if os.geteuid() == 0:
            raise


def _set_xattrs(fd: int, xattrs: dict[bytes, bytes] | None) -> None:
    for name, value in (xattrs or {}).items():
        os.setxattr(fd, name, value)


def copy_verified(src: str, commit: CommitInfo, dest: str, verify_dest: bool = True,
                  dir_fd: int | None = None, owner: tuple[int, int] | None = None,
                  xattrs: dict[bytes, bytes] | None = None) -> int:
    """Copy the committed version of `src` to `dest` via a temporary name; returns bytes.
    With `dir_fd`, `dest` is a name in that directory (see `_safepath.open_beneath`).

    Raises _Mismatch when the local bytes are not the committed ones, OSError on I/O errors;
    the temporary file is removed on any failure and `dest` is untouched.
    """
    d = os.path.dirname(dest) if dir_fd is None else ""
    tmp = os.path.join(d, f"{TMP_PREFIX}{os.getpid()}.{next(_tmp_counter)}")
    sfd = os.open(src, os.O_RDONLY)
    try:
        actual = os.fstat(sfd).st_size
        if actual != commit.size:
            raise _Mismatch(f"local copy has {actual} bytes, {commit.size} were committed "
                            "(changed after its last close)")
        dfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                      dir_fd=dir_fd)
        try:
            try:
                digest = hash_file(sfd, commit.size, lambda data: write_all(dfd, data))[0]
            except ChecksumError as e:
                raise _Mismatch(f"local copy: {e}") from None
            if digest != commit.xxh3:
                raise _Mismatch("local copy does not match its committed xxh3 (changed after close)")
            os.fsync(dfd)
            _chown(dfd, owner)  # before the mode: a chown clears set-id bits
            os.fchmod(dfd, stat.S_IMODE(commit.mode))
            _set_xattrs(dfd, xattrs)
        finally:
            os.close(dfd)
        if verify_dest:
            rfd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
            try:
                n = os.fstat(rfd).st_size
                back = hash_file(rfd, n)[0]
            finally:
                os.close(rfd)
            if n != commit.size or back != commit.xxh3:
                raise _Mismatch("the copy read back from the destination does not match")
        os.utime(tmp, ns=(commit.mtime_ns, commit.mtime_ns), dir_fd=dir_fd, follow_symlinks=False)
        os.replace(tmp, dest, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return commit.size
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    finally:
        os.close(sfd)


def _make_special(dfd: int, name: str, rec: Record, target: bytes) -> None:
    """A symlink (target) or special file (mode, rdev) with its owner and mtime, in place of
    whatever non-directory had that name."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dfd)
    if rec.kind == KIND_LINK:
        os.symlink(target, name, dir_fd=dfd)
    else:
        os.mknod(name, rec.mode, rec.first, dir_fd=dfd)
    try:
        os.chown(name, rec.uid, rec.gid, dir_fd=dfd, follow_symlinks=False)
    except PermissionError:
        if os.geteuid() == 0:
            raise
    if rec.kind != KIND_LINK:
        os.chmod(name, stat.S_IMODE(rec.mode), dir_fd=dfd)  # mknod obeys the umask
    os.utime(name, ns=(rec.mtime_ns, rec.mtime_ns), dir_fd=dfd, follow_symlinks=False)


def _split(rel: bytes) -> tuple[str, str]:
    parent, _, name = os.fsdecode(rel).rpartition("/")
    return parent, name


def _hard_link(root: int, to: bytes, rel: bytes, shown: str) -> None:
    """Make `rel` a hard link to the staged `to` (in place of a non-directory named `rel`)."""
    tparent, tname = _split(to)
    parent, name = _split(rel)
    sfd = open_beneath(root, tparent, shown=shown)
    try:
        dfd = open_beneath(root, parent, create=True, shown=shown)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dfd)
            os.link(tname, name, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)


def stage_out(
    stores_or_local_dirs: Sequence[WriteStore | str] | WriteStore | str,
    out_dir: str,
    workers: int = 4,
    verify_dest: bool = True,
    unclosed_is_failure: bool = True,
) -> StageOutSummary:
    """Copy every committed written file of the given stores into `out_dir` (see the module doc).

    A local dir given as a string is opened read-only (its journal replayed). Files never
    closed, or changed after their last close, are failures (`unclosed_is_failure`, the umount
    case: the local copy is kept) or only reported in `unclosed` (the recover case).
    """
    t0 = time.monotonic()
    if isinstance(stores_or_local_dirs, WriteStore | str):
        stores_or_local_dirs = [stores_or_local_dirs]
    out_dir = os.path.abspath(out_dir)
    summary = StageOutSummary()
    os.makedirs(out_dir, exist_ok=True)
    # Everything is created beneath this fd: no symlink inside DIR is ever followed.
    root = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    seen: dict[bytes, str] = {}
    jobs: list[tuple[bytes, str, CommitInfo, str]] = []
    dirs: list[tuple[bytes, int, int, bool]] = []
    owners: dict[bytes, tuple[int, int]] = {}
    specials: list[tuple[bytes, Record, bytes]] = []  # symlinks and special files
    xattrs: dict[bytes, dict[bytes, bytes]] = {}
    links: list[tuple[bytes, bytes]] = []  # (a file's other name, its first name)
    staged: set[bytes] = set()
    opened: list[WriteStore] = []
    try:
        for src in stores_or_local_dirs:
            if isinstance(src, str):
                if not os.path.exists(os.path.join(src, WRITES_DIR)):
                    summary.warnings.append(f"{src}: no written files")
                    continue
                store = WriteStore(src, readonly=True)
                opened.append(store)
            else:
                store = src
            summary.warnings.extend(store.warnings)
            label = store.local_dir
            first: dict[int, bytes] = {}  # inode: its first name (hard links)
            for rel, rec, commit, data in store.walk():
                owners[rel] = (rec.uid, rec.gid)
                if rec.kind == KIND_DIR or data is not None:
                    xs = store.xattrs(rel)
                    if xs:
                        xattrs[rel] = xs
                if rec.is_dir:
                    dirs.append((rel, rec.mode, rec.mtime_ns, store.is_shadow(rel)))
                    continue
                if rel in seen:
                    summary.failures.append(StageFailure(
                        os.fsdecode(rel), f"written on two ranks ({seen[rel]} and {label})",
                        data or ""))
                    continue
                seen[rel] = label
                if rec.inode in first:
                    links.append((rel, first[rec.inode]))
                    continue
                first[rec.inode] = rel
                if data is None:
                    target = store.readlink(rel) if rec.kind == KIND_LINK else b""
                    specials.append((rel, rec, target))
                    continue
                dirty = store.is_dirty(rel) if not store.readonly else commit is None
                if commit is None or (dirty and not store.readonly):
                    size = os.path.getsize(data) if os.path.exists(data) else 0
                    reason = "never closed" if commit is None else "changed after its last close"
                    u = Unclosed(os.fsdecode(rel), size, reason, data)
                    if unclosed_is_failure:
                        summary.failures.append(StageFailure(u.path, reason, data))
                    else:
                        summary.unclosed.append(u)
                    continue
                jobs.append((rel, data, commit, label))
        for rel, _mode, _mtime, _shadow in dirs:
            try:
                os.close(open_beneath(root, os.fsdecode(rel), create=True, shown=out_dir))
            except Escape as e:
                summary.failures.append(StageFailure(os.fsdecode(rel), str(e)))
            except OSError as e:
                summary.failures.append(StageFailure(os.fsdecode(rel), f"mkdir: {e.strerror}"))
        for rel, rec, target in specials:
            parent, name = _split(rel)
            try:
                dfd = open_beneath(root, parent, create=True, shown=out_dir)
                try:
                    _make_special(dfd, name, rec, target)
                finally:
                    os.close(dfd)
                summary.files += 1
                staged.add(rel)
            except Escape as e:
                summary.failures.append(StageFailure(os.fsdecode(rel), str(e)))
            except OSError as e:
                summary.failures.append(StageFailure(os.fsdecode(rel), f"{e.strerror or e}"))

        def one(job: tuple[bytes, str, CommitInfo, str]) -> tuple[bytes, int, str | None, bool]:
            rel, data, commit, _label = job
            parent, name = _split(rel)
            try:
                dfd = open_beneath(root, parent, create=True, shown=out_dir)
                try:
                    return (rel, copy_verified(data, commit, name, verify_dest, dfd, owners[rel],
                                               xattrs.get(rel)), None, False)
                finally:
                    os.close(dfd)
            except _Mismatch as e:
                return rel, 0, str(e), True
            except Escape as e:
                return rel, 0, str(e), False
            except OSError as e:
                return rel, 0, f"{e.strerror or e}", False

        by_rel = {j[0]: j for j in jobs}
        with ThreadPoolExecutor(max(1, workers)) as pool:
            for rel, n, err, mismatch in pool.map(one, jobs):
                if err is None:
                    summary.files += 1
                    staged.add(rel)
                    summary.bytes += n
                elif mismatch and not unclosed_is_failure:
                    data = by_rel[rel][1]
                    size = os.path.getsize(data) if os.path.exists(data) else 0
                    summary.unclosed.append(Unclosed(os.fsdecode(rel), size, err, data))
                else:
                    summary.failures.append(StageFailure(os.fsdecode(rel), err, by_rel[rel][1]))
        unclosed = {u.path for u in summary.unclosed}
        for rel, to in links:
            if to not in staged and os.fsdecode(to) in unclosed:  # recover: reported there
                summary.unclosed.append(Unclosed(os.fsdecode(rel), 0,
                                                 f"a hard link to {os.fsdecode(to)}"))
                continue
            try:
                _hard_link(root, to, rel, out_dir)
                summary.files += 1
            except Escape as e:
                summary.failures.append(StageFailure(os.fsdecode(rel), str(e)))
            except OSError as e:
                summary.failures.append(StageFailure(
                    os.fsdecode(rel), f"hard link to {os.fsdecode(to)}: {e.strerror or e}"))
        # Directory modes and mtimes last (deepest first), so a read-only dir can still be filled.
        for rel, mode, mtime, shadow in sorted(dirs, key=lambda t: -t[0].count(b"/")):
            try:
                fd = open_beneath(root, os.fsdecode(rel), shown=out_dir)
            except (Escape, OSError):
                continue  # reported when it was made
            try:
                with contextlib.suppress(OSError):
                    os.fsync(fd)
                if shadow:
                    continue
                _chown(fd, owners[rel])
                os.fchmod(fd, stat.S_IMODE(mode))
                _set_xattrs(fd, xattrs.get(rel))
                os.utime(fd, ns=(mtime, mtime))
                summary.dirs += 1
            except OSError as e:
                summary.failures.append(StageFailure(os.fsdecode(rel), f"set attributes: {e.strerror}"))
            finally:
                os.close(fd)
        with contextlib.suppress(OSError):
            os.fsync(root)
    except FanstoreError as e:
        summary.failures.append(StageFailure("", str(e)))
    finally:
        os.close(root)
        for s in opened:
            s.close_store()
    summary.seconds = time.monotonic() - t0
    for f in summary.failures:
        log.error("stage-out %s: %s (local copy kept at %s)", f.path, f.reason, f.local)
    return summary
