"""py-spy profiles of the fanstore-fuse daemons during a read workload.

The profiled run is an extra run of the workload (its rate is kept apart from the reported
figures: sampling costs CPU on a 2-core machine). ``py-spy record --nonblocking --format raw``
writes collapsed stacks; ``summarize`` turns them into the top frames by self and inclusive time.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

from ._util import pids_with_arg, venv_tool

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def daemon_pids(marker: str) -> list[int]:
    """fanstore-fuse daemon processes (python -m fanstore_fuse mount ... --foreground) of a mount."""
    out = []
    for pid in pids_with_arg(marker):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if (
            os.path.basename(cmd[0]).startswith(b"python")  # not mpiexec, which names it too
            and b"fanstore_fuse" in b" ".join(cmd)
            and b"--foreground" in cmd
        ):
            out.append(pid)
    return sorted(out)


class Profiler:
    """Context manager: one ``py-spy record`` per pid, stopped with SIGINT on exit."""

    def __init__(self, pids: list[int], out_prefix: Path, rate: int = 250):
        self.exe = venv_tool("py-spy")
        self.pids = pids
        self.out_prefix = out_prefix
        self.rate = rate
        self.procs: list[tuple[int, Path, subprocess.Popen]] = []
        self.error = ""

    def __enter__(self) -> Profiler:
        if not self.exe:
            self.error = "py-spy not installed (pip install py-spy)"
            return self
        if not self.pids:
            self.error = "no daemon pid found"
            return self
        for pid in self.pids:
            path = Path(f"{self.out_prefix}-pid{pid}.txt")
            p = subprocess.Popen(
                [self.exe, "record", "--pid", str(pid), "--format", "raw", "--output", str(path),
                 "--rate", str(self.rate), "--nonblocking", "--duration", "600"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            self.procs.append((pid, path, p))
        time.sleep(0.5)  # let py-spy attach
        return self

    def __exit__(self, *exc) -> None:
        for _pid, _path, p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGINT)
        for _pid, _path, p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
                self.error = self.error or "py-spy did not stop"
            if p.returncode not in (0, -signal.SIGINT, None) and not self.error:
                err = (p.stderr.read() if p.stderr else "") or ""
                self.error = f"py-spy exited {p.returncode}: {err.strip().splitlines()[:1]}"
        if self.files:
            self.error = ""  # some profile came back: summarize what there is

    @property
    def files(self) -> list[Path]:
        return [path for _pid, path, _p in self.procs if path.exists()]


def _short(frame: str) -> str:
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    f = m.group("file")
    f = f.split("site-packages/")[-1].split("src/")[-1]
    return f"{m.group('func')} ({os.path.basename(f) if '/' in f and 'fanstore' not in f else f})"


_ENTRY = ("cli.py", "__main__.py", "serve (fanstore_fuse/_daemon.py")

#: leaf frames that mean "blocked, waiting for work" (a thread parked in epoll or a condition)
WAIT_LEAVES = {"get_events", "wait", "_wait_for_tstate_lock", "select", "poll", "sleep"}


def summarize(files: list[Path], top: int = 12) -> dict:
    """Top frames by self time (leaf) and inclusive time over all collapsed-stack files."""
    self_c: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for path in files:
        for line in path.read_text(errors="replace").splitlines():
            stack, _, n = line.rpartition(" ")
            if not stack or not n.isdigit():
                continue
            k = int(n)
            frames = [_short(f) for f in stack.split(";") if f and not f.startswith("process ")]
            frames = [f for f in frames if not f.startswith("thread ")]
            if not frames:
                continue
            total += k
            self_c[frames[-1]] += k
            for f in set(frames):
                incl[f] += k
    if not total:
        return {"samples": 0}
    wait = sum(c for f, c in self_c.items() if f.split(" (")[0].split(".")[-1] in WAIT_LEAVES)
    return {
        "samples": total,
        "waiting_pct": round(100 * wait / total, 1),
        "self": [(f, round(100 * c / total, 1)) for f, c in self_c.most_common(top)],
        # inclusive time of the project's own functions (entry points and the serve loop left out)
        "inclusive": [
            (f, round(100 * c / total, 1)) for f, c in incl.most_common()
            if "fanstore_fuse/" in f and not any(x in f for x in _ENTRY)
        ][:top],
    }
