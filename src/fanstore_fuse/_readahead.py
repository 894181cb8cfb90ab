"""The mount's kernel read-ahead: raised so that buffered readers of large files send the
daemon 1 MiB reads instead of 128 KiB ones (8x fewer FUSE round trips per MiB).

The kernel takes the FUSE INIT reply's `max_readahead` as a ceiling on the mount's
read-ahead (`min(read_ahead_kb, what it offered at mount: 128 KiB)`), and it reads that reply
only once `pyfuse3.main` runs, after `pyfuse3.init` returned. A value written right after
`init` is therefore cut back to 128 KiB a moment later (a `dd bs=1M` through the mount then
reaches the daemon as 128 KiB requests). `set_readahead` writes it at mount; `hold_readahead`, a task of the
running daemon, watches for the cut and writes it again, once. Needs root (sysfs); without it
the default stays, silently.
"""

from __future__ import annotations

import logging

import trio

log = logging.getLogger("fanstore_fuse.daemon")
WATCH_S = 10.0  # how long hold_readahead waits for INIT to be answered
_POLL_S = 0.005


def bdi_path(mountpoint: str) -> str | None:
    """/sys/class/bdi/<major:minor>/read_ahead_kb of the mount at `mountpoint`, or None."""
    dev = None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4 and fields[4] == mountpoint:
                    dev = fields[2]
    except OSError:
        return None
    return None if dev is None else f"/sys/class/bdi/{dev}/read_ahead_kb"


def _read(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _write(path: str, kb: int) -> bool:
    try:
        with open(path, "w") as out:
            out.write(str(kb))
    except OSError as e:
        log.info("read-ahead left at the default (%s)", e)
        return False
    return True


def set_readahead(mountpoint: str, kb: int) -> None:
    """Raise the mount's read-ahead to `kb` KiB (see the module docstring: `hold_readahead`
    keeps it once the daemon answers INIT)."""
    path = bdi_path(mountpoint) if kb > 0 else None
    if path is not None and _write(path, kb):
        log.info("read-ahead of %s set to %d KiB", mountpoint, kb)


async def hold_readahead(
    mountpoint: str, kb: int, watch_s: float = WATCH_S, path: str | None = None
) -> None:
    """Once the kernel has cut the read-ahead back (INIT answered: at once if that happened
    before this task ran), set it to `kb` again. `path`: the sysfs file (default: the mount's)."""
    path = path or (bdi_path(mountpoint) if kb > 0 else None)
    if path is None or kb <= 0:
        return
    with trio.move_on_after(watch_s):
        while _read(path) == kb:
            await trio.sleep(_POLL_S)
    if _read(path) != kb and _write(path, kb):
        log.info("read-ahead of %s set to %d KiB after INIT", mountpoint, kb)

