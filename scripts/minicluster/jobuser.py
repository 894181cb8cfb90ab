"""Open a mount namespace to job users other than root, as a compute node is: used by a test
node's pid 1 (nodeinit.py) and by tests/_jobuser_ns.py. Nothing outside the namespace changes.

Two things of a test machine stop a job user that a compute node would not:
- /dev/fuse of mode 0600 (compute nodes have 0666): a node of mode 0666 is bound over it;
- an interpreter under a private home (/root, 0700): each directory that others may not
  search, on the way to what the interpreter needs, is covered by a tmpfs of mode 0755 holding
  only the entries needed, bound back from the original (kept reachable under `keep`, whose
  binds of the originals keep their own modes).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, timeout=30)


def open_fuse(keep: Path) -> bool:
    """/dev/fuse open to every user in this namespace; True when a node was bound over it."""
    if os.stat("/dev/fuse").st_mode & 0o006 == 0o006:
        return False
    node = keep / "fuse"
    if not node.exists():  # a node restarted over the same dir finds it there
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(10, 229))
    os.chmod(node, 0o666)
    _mount("--bind", str(node), "/dev/fuse")
    return True


def closed_dirs(paths: list[str]) -> dict[Path, set[str]]:
    """Directories on the way to `paths` that others may not search -> the entries needed."""
    out: dict[Path, set[str]] = {}
    for p in paths:
        parts = Path(p).parts
        for k in range(1, len(parts)):
            d = Path(*parts[:k])
            if not os.stat(d).st_mode & stat.S_IXOTH:
                out.setdefault(d, set()).add(parts[k])
    return out


def open_dirs(keep: Path, paths: list[str]) -> list[Path]:
    """Covers the closed directories; returns the originals' bind mounts under `keep`."""
    kept = []
    for i, (d, names) in enumerate(sorted(closed_dirs(paths).items())):
        orig = keep / f"dir{i}"
        orig.mkdir(exist_ok=True)
        _mount("--bind", str(d), str(orig))
        kept.append(orig)
        _mount("-t", "tmpfs", "-o", "mode=0755", "fanstore-test", str(d))
        for name in names:
            (d / name).mkdir()
            _mount("--bind", str(orig / name), str(d / name))
        _mount("-o", "remount,bind,ro", str(orig))  # the original, where only root can reach it
    return kept


def interpreter_paths(*more: str) -> list[str]:
    """What this interpreter needs to run: its binary, its prefixes, and `more`."""
    return [os.path.realpath(sys.executable), sys.prefix, sys.base_prefix, *more]


def tmp_tops(paths: list[str]) -> list[str]:
    """The entries of /tmp that `paths` lie under (a checkout or venv under /tmp), which a
    node's private /tmp would hide: nodeinit.py binds them back into it."""
    tops = set()
    for p in paths:
        parts = Path(os.path.realpath(p)).parts
        if len(parts) > 2 and parts[:2] == ("/", "tmp"):
            tops.add(parts[2])
    return sorted(tops)

