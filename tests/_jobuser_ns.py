"""Run a command where a job user other than root can use FUSE and this interpreter, inside a
private mount namespace (`unshare --mount --propagation private python -m tests._jobuser_ns
CMD...`, as root): nothing outside the namespace changes.

Two things of a test machine stop a job user that a compute node would not:
- /dev/fuse of mode 0600 (compute nodes have 0666): a node of mode 0666 is bound over it;
- an interpreter under a private home (/root, 0700): each directory that others may not
  search, on the way to what the interpreter needs, is covered by a tmpfs of mode 0755 holding
  only the entries needed, bound back from the original.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, timeout=30)


def open_fuse(keep: Path) -> None:
    if os.stat("/dev/fuse").st_mode & 0o006 == 0o006:
        return
    node = keep / "fuse"
    os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(10, 229))
    os.chmod(node, 0o666)
    _mount("--bind", str(node), "/dev/fuse")


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
        orig.mkdir()
        _mount("--bind", str(d), str(orig))
        kept.append(orig)
        _mount("-t", "tmpfs", "-o", "mode=0755", "fanstore-test", str(d))
        for name in names:
            (d / name).mkdir()
            _mount("--bind", str(orig / name), str(d / name))
    return kept


def main() -> int:
    cmd = sys.argv[1:]
    keep = Path(tempfile.mkdtemp(prefix="fanstore-jobuser-ns-"))
    kept: list[Path] = []
    try:
        open_fuse(keep)
        needed = [os.path.realpath(sys.executable), sys.prefix, sys.base_prefix,
                  os.path.realpath(Path(__file__).resolve().parent.parent)]
        kept = open_dirs(keep, needed)
        env = {**os.environ, "FANSTORE_TEST_JOBUSER_NS": "1"}
        return subprocess.run(cmd, env=env).returncode
    finally:
        # `keep` is on the machine's own /tmp: empty it, never through a bind (rmdir, not rm -r)
        for orig in kept:
            subprocess.run(["umount", "-l", str(orig)], timeout=30)
            orig.rmdir()
        if (keep / "fuse").exists():
            subprocess.run(["umount", "-l", "/dev/fuse"], timeout=30)
            (keep / "fuse").unlink()
        keep.rmdir()


if __name__ == "__main__":
    sys.exit(main())
