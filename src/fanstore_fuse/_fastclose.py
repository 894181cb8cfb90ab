"""FOPEN_NOFLUSH for read-only opens on a writable mount, FOPEN_CACHE_DIR for the listings
of the dataset's directories, plain READDIR and dataset lookups and listings answered in C
(`_shim_readdir.c`, issue 14), through the `_noflush` C shim.

The kernel sends FLUSH on every close(2) unless open answered FOPEN_NOFLUSH; pyfuse3's FileInfo
cannot say so. `load()` (run when the package's `__init__` imports this module, before anything
imports pyfuse3: Python loads extensions with RTLD_NOW, so pyfuse3 binds libfuse's functions at
import) puts
`_noflush` in the global symbol scope, where its `fuse_reply_open` comes before libfuse's.
Disabled, it passes every reply through; `enable_noflush()` makes it set `noflush` for O_RDONLY
opens. Files opened for writing still get FLUSH, which commits them on close. Without the shim
(no C compiler at install), or when pyfuse3 was imported first, every close is flushed.
"""

from __future__ import annotations

import logging
import os
import sys
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._format import Manifest

log = logging.getLogger("fanstore_fuse.fastclose")

_shim: ModuleType | None = None
_why = "not loaded"


def load() -> None:
    global _shim, _why
    if "pyfuse3" in sys.modules:
        _why = "pyfuse3 was imported before fanstore_fuse"
        return
    flags = sys.getdlopenflags()
    sys.setdlopenflags(flags | os.RTLD_GLOBAL)
    try:
        from . import _noflush  # type: ignore[attr-defined]
    except ImportError as e:
        _why = f"shim not built: {e}"
        return
    finally:
        sys.setdlopenflags(flags)
    _shim = _noflush


def enable_noflush() -> bool:
    """Turn the shim on; False (with one log line) when it is not there or not usable."""
    if _shim is None:
        log.info("no FOPEN_NOFLUSH (%s): every close of a file is flushed", _why)
        return False
    try:
        _shim.enable(True)
    except OSError as e:
        log.warning("FOPEN_NOFLUSH shim not usable: %s", e)
        return False
    return True


def cache_listing(fh: int) -> bool:
    """Ask the kernel to cache the listing of the directory whose opendir is answered next
    with `fh` (FOPEN_CACHE_DIR + FOPEN_KEEP_CACHE). Call it just before `opendir` returns."""
    if _shim is None:
        return False
    try:
        _shim.mark_dir(fh)
    except OSError:
        return False
    return True


def cached_listings() -> int:
    """Opendir replies sent with FOPEN_CACHE_DIR by this process."""
    return int(_shim.dirs()) if _shim is not None else 0


def patched_sessions() -> int:
    """FUSE sessions this process created with the shim's patched table of operations."""
    return int(_shim.patched()) if _shim is not None else 0


PLAIN_FH = 1 << 63  # set by _shim_readdir.c on the handle of a plain READDIR request


def plain_entries(on: bool) -> None:
    """While on, pyfuse3.readdir_reply writes plain READDIR entries (inode and type only): only
    around the replies of a request whose handle had PLAIN_FH, with no await in between."""
    if _shim is not None:
        _shim.plain_entries(on)


def readdir_stats() -> dict[str, int]:
    """READDIRPLUS_AUTO granted at init (0/1), READDIR requests, plain entries Python wrote,
    LOOKUPs and listing replies answered in C from the manifest's columns."""
    keys = ("auto", "readdir", "plain_entries", "c_lookups", "c_listings")
    return dict(zip(keys, _shim.readdir_stats() if _shim is not None else (0,) * 5, strict=True))


def hold_dataset(m: Manifest) -> None:
    """Hand the manifest's entry columns to the shim (`_shim_dataset.c`), which holds them for
    every answer it gives from the dataset (`_fastopen`, `serve_dataset`) until the process
    ends; the same columns handed over again change nothing. Raises what the shim raises
    (ValueError, TypeError, BufferError); the shim must be loaded."""
    assert _shim is not None
    e = m.entries
    cols = (e["kind"], e["mode"], e["uid"], e["gid"], e["count"], e["mtime_ns"], e["size"],
            e["first"], m.name_off, m.names)
    _shim.hold_dataset(cols, m.n_entries)


def root_owner(ids: tuple[int, int] | None) -> None:
    """The dataset's root shows these owner ids (uid, gid) in the shim's answers too, as in
    Python's (`MountView.root_owner`); None: the manifest's. Nothing without the shim."""
    if _shim is not None:
        _shim.dataset_root_owner(*(ids or ()))


def serve_dataset(m: Manifest, timeout: float, plus_max: int) -> bool:
    """Let the shim answer LOOKUP of dataset names and the dataset part of dataset listings
    from the manifest's columns (`hold_dataset`), with `timeout` as entry and attribute
    timeout and at most `plus_max` entries (0: no limit) per READDIRPLUS reply. Only once the
    dataset's metadata is answered locally. False without a patched session."""
    if _shim is None:
        return False
    try:
        hold_dataset(m)
        _shim.serve_dataset(timeout, plus_max)
    except (OSError, ValueError, TypeError, BufferError) as err:
        log.info("dataset lookups and listings stay in Python: %s", err)
        return False
    log.info("dataset lookups and listings answered by the C shim")
    return True


def noflush_opens() -> int:
    """Opens answered with FOPEN_NOFLUSH by this process."""
    return int(_shim.count()) if _shim is not None else 0


load()
