"""Start a mount daemon in the background and return once its mount answers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from ._errors import FanstoreError
from ._mountctl import mount_key, state_dir


def log_path(mountpoint: str) -> str:
    return os.path.join(state_dir(), f"{mount_key(mountpoint)}.log")


def wait_answers(mountpoint: str, timeout: float) -> None:
    """Readiness, not a sleep: stat the mount root from a thread, bounded by `timeout`."""
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        st = pool.submit(os.stat, mountpoint).result(timeout=timeout)
    except FutureTimeout:
        raise FanstoreError(f"mount at {mountpoint} did not answer within {timeout:.0f} s") from None
    except OSError as e:
        raise FanstoreError(f"mount at {mountpoint} does not answer: {e.strerror}") from None
    finally:
        pool.shutdown(wait=False)
    if st.st_ino != 1:
        raise FanstoreError(f"{mountpoint} is not the fanstore-fuse mount (inode {st.st_ino})")


def start_background(argv: list[str], mountpoint: str, timeout: float = 600.0) -> int:
    """Run `fanstore-fuse <argv> --ready-fd N` detached; return its pid once ready."""
    r, w = os.pipe()
    logp = log_path(mountpoint)
    with open(logp, "ab") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fanstore_fuse", *argv, "--ready-fd", str(w)],
            stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, pass_fds=(w,),
            start_new_session=True, close_fds=True,
        )
    os.close(w)
    deadline = time.monotonic() + timeout
    buf = b""
    with os.fdopen(r, "rb", buffering=0) as rf:
        while b"\n" not in buf:
            chunk = rf.read(4096)
            if not chunk:
                break
            buf += chunk
    line = buf.decode(errors="replace").strip()
    if line != "ready":
        proc.wait(timeout=30)
        if not line:
            tail = _tail(logp)
            raise FanstoreError(f"mount daemon exited (code {proc.returncode}): {tail}")
        raise FanstoreError(line.removeprefix("error: "))
    wait_answers(mountpoint, max(5.0, deadline - time.monotonic()))
    return proc.pid


def _tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            lines = f.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else "(no log)"
    except OSError:
        return "(no log)"
