"""Paths another user cannot redirect: private directories, files opened without following
symlinks, and resolution that stays beneath a directory.

`secure_dir` is the check for every directory we keep state or data in (state dir, local dirs):
it must be ours, writable only by us, and under directories nobody else can swap. Inside such a
directory `open_private` creates files (`O_NOFOLLOW`, one link, ours). `open_beneath` walks a
relative path under a directory fd one component at a time, refusing symlinks and `..`
(`openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` where the kernel has it, otherwise an
`O_NOFOLLOW | O_DIRECTORY` openat walk), for stage-out and recover.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Iterator
from typing import NoReturn

from ._errors import FanstoreError


def _check_ancestors(path: str, what: str, shown: str) -> None:
    """Every directory from / down to `path` must be owned by root or this user, and be
    writable by nobody else unless sticky (like /tmp): otherwise another user could swap it."""
    me = os.geteuid()
    p = os.path.realpath(path)
    while True:
        st = os.stat(p)
        if st.st_uid not in (0, me):
            raise FanstoreError(f"{what} {shown}: {p} belongs to uid {st.st_uid}, not to you or "
                                "root: set FANSTORE_STATE_DIR/--local to a directory of yours")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise FanstoreError(f"{what} {shown}: {p} is writable by other users (mode "
                                f"{stat.S_IMODE(st.st_mode):04o}): use a directory only you "
                                "can change")
        parent = os.path.dirname(p)
        if parent == p:
            return
        p = parent


def secure_dir(path: str, what: str = "directory") -> str:
    """Create `path` (0700) if missing and return it; refuse (FanstoreError, one line) a
    symlink, a directory owned by another user or writable by group or others, one under a
    directory another user could swap, or one this user cannot create or enter."""
    path = os.path.abspath(path)
    try:
        existing = path
        while not os.path.lexists(existing):
            existing = os.path.dirname(existing)
        _check_ancestors(existing if existing != path else os.path.dirname(path), what, path)
        os.makedirs(path, mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FanstoreError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP or os.path.islink(path):
            raise FanstoreError(f"{what} {path} is a symlink: refusing it (remove it, or set "
                                "FANSTORE_STATE_DIR to a directory of yours)") from None
        raise FanstoreError(f"cannot use {what} {path}: {e.strerror} (set FANSTORE_STATE_DIR "
                            "to a directory you own)") from None
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid != os.geteuid():
        raise FanstoreError(f"{what} {path} belongs to uid {st.st_uid}, not to you: remove it "
                            "or set FANSTORE_STATE_DIR to a directory of yours")
    if st.st_mode & 0o022:
        raise FanstoreError(f"{what} {path} is writable by other users (mode "
                            f"{stat.S_IMODE(st.st_mode):04o}): chmod go-w it or use another")
    return path


def open_private(path: str, flags: int) -> int:
    """Open (creating 0600) a file of ours inside a checked directory: never through a
    symlink, never a file of another user or one with other names (hard links)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise FanstoreError(f"{path} is a symlink: refusing to write through it") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink > 1:
        os.close(fd)
        raise FanstoreError(f"{path} is not a plain file of yours with one name: refusing it")
    return fd


class Escape(FanstoreError):
    """A path that would leave the directory it must stay beneath (a symlink, `..`)."""


_SYS_OPENAT2 = 437  # the same number on every Linux architecture (new syscall table)
_RESOLVE_NO_MAGICLINKS, _RESOLVE_NO_SYMLINKS, _RESOLVE_BENEATH = 0x02, 0x04, 0x08
_Openat2 = Callable[[int, bytes, int, int], int]
_openat2_state: list[_Openat2 | None] = []  # [] untried, [fn] usable, [None] not here


def _openat2_fn() -> _Openat2 | None:
    if not _openat2_state:
        import ctypes

        class OpenHow(ctypes.Structure):
            _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                        ("resolve", ctypes.c_uint64)]

        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long

        def openat2(dirfd: int, path: bytes, flags: int, resolve: int) -> int:
            how = OpenHow(flags, 0, resolve)
            fd = libc.syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dirfd),
                              ctypes.c_char_p(path), ctypes.byref(how),
                              ctypes.c_size_t(ctypes.sizeof(how)))
            if fd < 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err), os.fsdecode(path))
            return int(fd)

        _openat2_state.append(openat2)
    return _openat2_state[0]


def _open_dir_at(dirfd: int, rel: str) -> int:
    """One or more components under `dirfd`, no symlink followed, nothing above `dirfd`."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    fn = _openat2_fn()
    if fn is not None:
        try:
            return fn(dirfd, os.fsencode(rel), flags,
                      _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS)
        except OSError as e:
            if e.errno not in (errno.ENOSYS, errno.EPERM):  # EPERM: a seccomp filter
                raise
            _openat2_state[0] = None
    return _walk(dirfd, rel.split("/"),
                 lambda fd, _i, comp: os.open(comp, flags | os.O_NOFOLLOW, dir_fd=fd))


def _walk(dirfd: int, comps: list[str], step: Callable[[int, int, str], int]) -> int:
    """Descend from `dirfd` through `comps`; `step(fd, i, comp)` opens the next one."""
    fd = os.dup(dirfd)
    try:
        for i, comp in enumerate(comps):
            nfd = step(fd, i, comp)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_beneath(root_fd: int, rel: str, create: bool = False, shown: str = "DIR") -> int:
    """A directory fd for `root/rel` (made, umask-limited, where missing with `create`),
    refusing symlinks, `..` and absolute paths at every step (Escape, naming the component)."""
    comps = [c for c in rel.split("/") if c not in ("", ".")]
    if rel.startswith("/") or ".." in comps:
        raise Escape(f"{os.path.join(shown, rel)}: not a path beneath {shown}")
    if not comps:
        return os.dup(root_fd)
    try:
        return _open_dir_at(root_fd, "/".join(comps))
    except OSError as e:
        if not (create and e.errno == errno.ENOENT):
            _refuse(root_fd, comps, shown, e)

    def make(fd: int, i: int, comp: str) -> int:
        with contextlib.suppress(FileExistsError):
            os.mkdir(comp, 0o777, dir_fd=fd)
        try:
            return _open_dir_at(fd, comp)
        except OSError as e:
            _refuse(root_fd, comps[: i + 1], shown, e)

    return _walk(root_fd, comps, make)


@contextlib.contextmanager
def dir_beneath(top: str, rel: str) -> Iterator[int]:
    """`open_beneath(top, rel, create=True)` as a context: the directory fd, closed after."""
    root = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = open_beneath(root, rel, create=True, shown=top)
    finally:
        os.close(root)
    try:
        yield fd
    finally:
        os.close(fd)


def _refuse(root_fd: int, comps: list[str], shown: str, e: OSError) -> NoReturn:
    """Raise Escape naming the first symlink among `comps`, else re-raise `e`."""
    for i in range(len(comps)):
        rel = "/".join(comps[: i + 1])
        try:
            st = os.lstat(rel, dir_fd=root_fd)
        except OSError:
            break
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(rel, dir_fd=root_fd)
            raise Escape(f"{os.path.join(shown, rel)} is a symlink (to {target}): refusing to "
                         f"write through it, only beneath {shown}") from None
        if not stat.S_ISDIR(st.st_mode):
            raise Escape(f"{os.path.join(shown, rel)} is not a directory") from None
    if e.errno in (errno.ELOOP, errno.EXDEV):
        raise Escape(f"{os.path.join(shown, '/'.join(comps))}: leaves {shown} (symlink)") from None
    raise e
