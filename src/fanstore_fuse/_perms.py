"""Who may read a dataset: `prep` keeps DEST as private as its source; `verify`/`mount` warn.

A tree's *access* is the widest class of users that can read all of it: its owner only, one
group, or everyone. An entry grants a class read access when the class has `r` on a file, `r`
and `x` on a directory of the tree, and `x` on every directory above the source. The tree's
access is the narrowest of its entries' (two different groups make it owner-only).

`prep` runs under umask 077 (every file it creates is 0600, every directory 0700, from the first
byte on), then opens DEST up to the source's access (0640/0750 with the source's group, or
0644/0755) or to what `--mode`/`--group` ask for, and records what it applied in the extended
attribute `user.fanstore.access` of DEST (text `fanstore-access 1 LEVEL`, LEVEL one of
`owner`, `group:GID`, `others`). `verify` and `mount` compare what DEST grants now (its files
and the directories above them) with that record, or, where the attribute is missing (another
file system, a copy), with the access the manifest's own modes and groups describe.
"""

from __future__ import annotations

import contextlib
import functools
import grp
import logging
import os
import re
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from ._errors import FanstoreError

log = logging.getLogger("fanstore_fuse.perms")

OWNER, GROUP, OTHERS = 0, 1, 2
ACCESS_XATTR = "user.fanstore.access"
ACCESS_MAGIC = "fanstore-access"
ACCESS_VERSION = 1
_FILE_MODES = {OWNER: 0o600, GROUP: 0o640, OTHERS: 0o644}
_DIR_MODES = {OWNER: 0o700, GROUP: 0o750, OTHERS: 0o755}
_FIX = {OWNER: "go-rwx", GROUP: "o-rwx", OTHERS: "g-w,o-w"}  # what takes DEST back
_DATA = re.compile(r"(part|bcast)-\d{5}\.fsp")


@dataclass(frozen=True)
class Access:
    level: int = OWNER
    gid: int = -1  # the group, when level == GROUP

    def narrow(self, other: Access) -> Access:
        """The access of a tree holding both."""
        if self.level != other.level:
            return self if self.level < other.level else other
        if self.level == GROUP and self.gid != other.gid:
            return Access(OWNER)
        return self

    def wider_than(self, other: Access) -> bool:
        if self.level != other.level:
            return self.level > other.level
        return self.level == GROUP and self.gid != other.gid

    def describe(self) -> str:
        if self.level == OTHERS:
            return "everyone"
        if self.level == GROUP:
            return f"group {_group_name(self.gid)}"
        return "its owner only"

    def encode(self) -> bytes:
        lvl = {OWNER: "owner", GROUP: f"group:{self.gid}", OTHERS: "others"}[self.level]
        return f"{ACCESS_MAGIC} {ACCESS_VERSION} {lvl}".encode()

    @classmethod
    def decode(cls, raw: bytes) -> Access:
        try:
            magic, version, lvl = raw.decode("ascii").split(" ")
            if magic != ACCESS_MAGIC or int(version) != ACCESS_VERSION:
                raise ValueError
            if lvl.startswith("group:"):
                return cls(GROUP, int(lvl[6:]))
            return cls({"owner": OWNER, "others": OTHERS}[lvl])
        except (ValueError, KeyError):
            raise FanstoreError(f"unreadable {ACCESS_XATTR} value {raw[:64]!r}") from None


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def grants(mode: int, gid: int, need: int) -> Access:
    """The widest class for which `mode` has every bit of `need` (an `o` triple: 4 r, 1 x)."""
    if mode & need == need:
        return Access(OTHERS)
    if (mode >> 3) & need == need:
        return Access(GROUP, gid)
    return Access(OWNER)


def path_access(path: str) -> Access:
    """Who may pass through every directory from / down to `path` (itself included)."""
    acc = Access(OTHERS)
    p = os.path.realpath(path)
    while True:
        st = os.stat(p)
        acc = acc.narrow(grants(st.st_mode, st.st_gid, 0o1))
        parent = os.path.dirname(p)
        if parent == p:
            return acc
        p = parent


def tree_access(kinds: Iterable[int], modes: Iterable[int], gids: Iterable[int],
                dir_kind: int, link_kind: int) -> Access:
    """The access the entries of a manifest (kind, mode and group columns) describe."""
    acc = Access(OTHERS)
    for kind, mode, gid in set(zip(kinds, modes, gids)):  # few distinct ones: C-speed dedup
        if kind != link_kind:
            acc = acc.narrow(grants(mode, gid, 0o5 if kind == dir_kind else 0o4))
    return acc


def parse_mode(text: str | None) -> int | None:
    """`--mode`: octal file mode for DEST's files."""
    if text is None:
        return None
    try:
        return check_mode(int(text, 8))
    except ValueError:
        raise FanstoreError(f"--mode must be octal (e.g. 0640), got {text!r}") from None


def check_mode(mode: int | None) -> int | None:
    if mode is not None and (mode & ~0o666 or not mode & 0o400):
        raise FanstoreError(f"--mode must be within 0666 and readable by the owner, got {mode:o}")
    return mode


def parse_group(name: str | None) -> int | None:
    if name is None:
        return None
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        if name.isdigit():
            return int(name)
        raise FanstoreError(f"--group: no group named {name!r}") from None


@contextlib.contextmanager
def private_umask() -> Iterator[None]:
    """Everything created inside is 0600/0700 at most (process-wide while it lasts)."""
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


def open_up(dest: str, names: Iterable[str], mode: int | None, group: int | None,
            source: Access) -> Access:
    """Give DEST and its files the source's access, or the explicit mode/group; record it."""
    if mode is None and group is None:
        fmode, dmode, gid = _FILE_MODES[source.level], _DIR_MODES[source.level], source.gid
    else:
        fmode = mode if mode is not None else 0o640
        dmode = fmode | ((fmode & 0o444) >> 2)
        gid = group if group is not None else -1
    paths = [os.path.join(dest, n) for n in names]
    if gid >= 0:
        try:
            for p in [dest, *paths]:
                os.chown(p, -1, gid, follow_symlinks=False)
        except PermissionError:
            if group is not None:
                raise FanstoreError(f"--group: cannot give {dest} to group "
                                    f"{_group_name(gid)} (not a member?)") from None
            log.warning("DEST stays private: cannot give it to the source's group %s",
                        _group_name(gid))
            fmode, dmode = fmode & 0o700, dmode & 0o700
    for p in paths:
        os.chmod(p, fmode, follow_symlinks=False)
    try:
        os.chmod(dest, dmode)
    except PermissionError:  # a directory someone else made for us: its files are ours
        log.warning("%s is not yours: its mode stays %04o", dest, stat.S_IMODE(os.stat(dest).st_mode))
    st = os.stat(dest)
    applied = grants(fmode, st.st_gid, 0o4)
    with contextlib.suppress(OSError):  # a file system without user xattrs: verify falls back
        os.setxattr(dest, ACCESS_XATTR, applied.encode())
    return applied


def recorded_access(dest: str) -> Access | None:
    try:
        return Access.decode(os.getxattr(dest, ACCESS_XATTR))
    except (OSError, FanstoreError):
        return None


def widened(dest: str, names: Iterable[str], allowed: Access) -> str | None:
    """A one-line warning if a file of DEST can be read by more users than `allowed`."""
    try:
        above = path_access(dest)
        for n in names:
            st = os.stat(os.path.join(dest, n))
            reach = above.narrow(grants(st.st_mode, st.st_gid, 0o4))
            if reach.wider_than(allowed):
                return (f"{dest} is readable by {reach.describe()} ({n} is "
                        f"{stat.S_IMODE(st.st_mode):04o}) but its source was readable by "
                        f"{allowed.describe()}: `chmod -R {_FIX[allowed.level]} {dest}` (or "
                        "prep with --mode/--group to share on purpose)")
    except OSError:
        return None  # missing files are verify's and mount's to report
    return None


def _distinct(kinds: Any, modes: Any, gids: Any) -> tuple[list[int], list[int], list[int]]:
    """The distinct (kind, mode, gid) triples of three manifest columns (numpy: millions of
    entries in milliseconds)."""
    import numpy as np

    key = (np.frombuffer(kinds, np.uint8).astype(np.uint64) << np.uint64(48)
           | (np.frombuffer(modes, "<u4").astype(np.uint64) & np.uint64(0xFFFF)) << np.uint64(32)
           | np.frombuffer(gids, "<u4").astype(np.uint64))
    u = np.unique(key)
    return ((u >> np.uint64(48)).tolist(), ((u >> np.uint64(32)) & np.uint64(0xFFFF)).tolist(),
            (u & np.uint64(0xFFFFFFFF)).tolist())


def dest_warning(dest: str) -> str | None:
    """`verify`/`mount`: one line if DEST is readable by more users than prep allowed."""
    from ._columns import read_columns
    from ._format import KIND_DIR, KIND_LINK, MANIFEST_NAME, PARTITION_NAME_RE

    dest = os.path.abspath(dest)
    allowed = recorded_access(dest)
    if allowed is None:
        try:  # three checksummed columns, not a full validation (mount validates)
            parts, col = read_columns(os.path.join(dest, MANIFEST_NAME), ("kind", "mode", "gid"))
        except (OSError, FanstoreError):
            return None  # the caller reports a bad manifest
        allowed = tree_access(*_distinct(col["kind"], col["mode"], col["gid"]), KIND_DIR, KIND_LINK)
        names = [MANIFEST_NAME, *(p.name for p in parts if PARTITION_NAME_RE.fullmatch(p.name))]
    else:
        try:
            names = [MANIFEST_NAME, *sorted(n for n in os.listdir(dest) if _DATA.fullmatch(n))]
        except OSError:
            return None
    return widened(dest, names, allowed)


F = TypeVar("F", bound=Callable[..., Any])


def keep_source_access(prep_fn: F) -> F:
    """Wrap `prep(src, dest, options, ...)`: DEST gets the access of SRC (see the module doc)."""

    @functools.wraps(prep_fn)
    def wrapper(src: Any, dest: Any, options: Any = None, *args: Any, **kw: Any) -> Any:
        mode = check_mode(getattr(options, "mode", None))
        group = parse_group(getattr(options, "group", None))
        with private_umask():
            res = prep_fn(src, dest, options, *args, **kw)
        from ._format import KIND_DIR, KIND_LINK, MANIFEST_NAME

        m = res.manifest
        source = path_access(os.fspath(src)).narrow(
            tree_access(m.entries["kind"], m.entries["mode"], m.entries["gid"], KIND_DIR, KIND_LINK))
        names = [MANIFEST_NAME, *(p.name for p in m.partitions)]
        applied = open_up(os.fspath(dest), names, mode, group, source)
        if applied.wider_than(source):
            log.warning("DEST is readable by %s, its source by %s (as --mode/--group asked)",
                        applied.describe(), source.describe())
        return res

    return cast(F, wrapper)
