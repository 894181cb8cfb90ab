"""Crash recovery: rescue the written files of a local dir whose daemon is gone (e.g. SIGKILL).

Pure library code. The journal is replayed read-only (the written files are not changed);
every file closed (or fsync'd) before the crash, whose bytes still match the recorded xxh3, is
staged out exactly as `_stageout.stage_out` does; files open for writing at the crash are
reported in `unclosed` (optionally salvaged, unverified, under `out_dir/.fanstore-unclosed/`).
When every written file was saved, the local dir is marked so (`_mountctl.mark_saved`): the
SLURM epilog and `umount` then remove it instead of keeping it for another rescue.
"""

from __future__ import annotations

import contextlib
import os
import shutil

from ._errors import FanstoreError
from ._mountctl import LOCAL_MARKER, _is_ours, mark_saved, pid_alive, writes_fingerprint
from ._safepath import Escape, dir_beneath
from ._stageout import StageFailure, StageOutSummary, stage_out
from .writes import JOURNAL_NAME, WRITES_DIR, WriteStore

UNCLOSED_DIR = ".fanstore-unclosed"


def _salvage(src: str, out_dir: str, rel: str) -> None:
    """Copy `src` (unverified) to OUT/rel, resolved beneath OUT (no symlink followed)."""
    parent, _, name = rel.rpartition("/")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    with dir_beneath(out_dir, parent) as dfd:
        try:
            with os.fdopen(os.open(name, flags, 0o600, dir_fd=dfd), "wb") as fout, \
                    open(src, "rb") as fin:
                shutil.copyfileobj(fin, fout)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dfd)
            raise


def owner_pid(local_dir: str) -> int:
    """The pid recorded in the local dir's marker if that daemon still runs, else 0."""
    try:
        with open(os.path.join(local_dir, LOCAL_MARKER)) as f:
            pid = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
    if pid != os.getpid() and pid_alive(pid) and _is_ours(pid):
        return pid
    return 0


def recover(
    local_dir: str,
    out_dir: str,
    workers: int = 4,
    force: bool = False,
    salvage_unclosed: bool = False,
    verify_dest: bool = True,
) -> StageOutSummary:
    """Stage out every closed file of a dead daemon's local dir; see the module docstring.

    Raises FanstoreError when `local_dir` has no write journal or a live daemon still owns it
    (unless `force`). The summary's `ok` is False if any closed file could not be saved;
    unclosed files do not make it fail (they are listed in `unclosed`).
    """
    local_dir = os.path.abspath(local_dir)
    if not os.path.exists(os.path.join(local_dir, WRITES_DIR, JOURNAL_NAME)):
        raise FanstoreError(f"{local_dir} holds no written files (no {WRITES_DIR}/{JOURNAL_NAME})")
    pid = owner_pid(local_dir)
    if pid and not force:
        raise FanstoreError(
            f"{local_dir} belongs to running daemon pid {pid}: use `fanstore-fuse umount "
            "--stage-out` instead (or force)"
        )
    before = writes_fingerprint(local_dir)
    store = WriteStore(local_dir, readonly=True)
    try:
        summary = stage_out([store], out_dir, workers, verify_dest, unclosed_is_failure=False)
        if summary.ok and not summary.unclosed:  # every written file saved: the epilog may go
            mark_saved(local_dir, out_dir, before)
        if salvage_unclosed:
            for u in summary.unclosed:
                try:
                    _salvage(u.local, out_dir, f"{UNCLOSED_DIR}/{u.path}")
                except Escape as e:
                    summary.failures.append(StageFailure(u.path, f"salvage: {e}", u.local))
                except OSError as e:
                    summary.failures.append(StageFailure(u.path, f"salvage: {e.strerror}", u.local))
    finally:
        store.close_store()
    return summary
