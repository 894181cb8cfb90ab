"""Run a command where a job user other than root can use FUSE and this interpreter, inside a
private mount namespace (`unshare --mount --propagation private python tests/_jobuser_ns.py
CMD...`, as root): nothing outside the namespace changes. The opening itself is
scripts/minicluster/jobuser.py's (a test cluster's nodes do the same)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts" / "minicluster"))

import jobuser  # noqa: E402


def main() -> int:
    cmd = sys.argv[1:]
    keep = Path(tempfile.mkdtemp(prefix="fanstore-jobuser-ns-"))
    kept: list[Path] = []
    fuse = False
    try:
        fuse = jobuser.open_fuse(keep)
        kept = jobuser.open_dirs(keep, jobuser.interpreter_paths(os.path.realpath(REPO)))
        env = {**os.environ, "FANSTORE_TEST_JOBUSER_NS": "1"}
        return subprocess.run(cmd, env=env).returncode
    finally:
        # `keep` is on the machine's own /tmp: empty it, never through a bind (rmdir, not rm -r)
        for orig in kept:
            subprocess.run(["umount", "-l", str(orig)], timeout=30)
            orig.rmdir()
        if fuse:
            subprocess.run(["umount", "-l", "/dev/fuse"], timeout=30)
            (keep / "fuse").unlink()
        keep.rmdir()


if __name__ == "__main__":
    sys.exit(main())
