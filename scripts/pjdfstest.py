"""Run pjdfstest (the POSIX conformance suite) in a written directory of a single-node mount.

    python scripts/pjdfstest.py [--tarball PATH] [--dirs chmod,open,...] [--json OUT]

Builds pjdfstest from the tarball in ../shared/tools/ (autoconf, automake, libtool; installed
with apt when missing and root), preps a tiny dataset, mounts it with `-o allow_other`, makes a
written directory `w/` in the mount and runs `prove -v` on each test directory from inside it.
Prints ok / planned per directory and in total; exits 0 (the counts are the result; the test
suite decides on the bar). Always unmounts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TARBALL = ROOT.parent / "shared" / "tools" / "pjdfstest-85a8aea.tar.gz"
DIRS = ["chflags", "chmod", "chown", "ftruncate", "granular", "link", "mkdir", "mkfifo", "mknod",
        "open", "posix_fallocate", "rename", "rmdir", "symlink", "truncate", "unlink", "utimensat"]
CLI = [sys.executable, "-m", "fanstore_fuse"]


def build(tarball: Path, into: Path) -> Path:
    """Build pjdfstest under INTO and return its source dir (which holds tests/ and the binary)."""
    src = into / "pjdfstest"
    if (src / "pjdfstest").exists():
        return src
    if shutil.which("autoreconf") is None and os.geteuid() == 0:
        subprocess.run(["apt-get", "install", "-y", "-q", "autoconf", "automake", "libtool"],
                       check=True, capture_output=True)
    subprocess.run(["tar", "xzf", str(tarball), "-C", str(into)], check=True)
    for cmd in (["autoreconf", "-ifs"], ["./configure"], ["make", "-j2"]):
        subprocess.run(cmd, cwd=src, check=True, capture_output=True)
    return src


def run_dir(tests: Path, name: str, cwd: Path, timeout: float) -> tuple[int, int, list[str]]:
    """(ok, planned, failing test lines) of one test directory, from prove's verbose TAP."""
    try:
        r = subprocess.run(["prove", "-rv", str(tests / name)], cwd=cwd, capture_output=True,
                           text=True, errors="replace", timeout=timeout)
        out = r.stdout
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    planned = sum(int(m.group(1)) for m in re.finditer(r"^1\.\.(\d+)", out, re.M))
    ok = len(re.findall(r"^ok \d+", out, re.M))
    fails = re.findall(r"^not ok \d+.*$", out, re.M)
    return ok, planned, fails


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tarball", type=Path, default=DEFAULT_TARBALL)
    ap.add_argument("--dirs", default=",".join(DIRS))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--timeout", type=float, default=600)
    a = ap.parse_args()
    if not a.tarball.exists():
        print(f"pjdfstest: no tarball at {a.tarball}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="fanstore-pjd-"))
    env = dict(os.environ, FANSTORE_STATE_DIR=str(work / "state"), TMPDIR=str(work))
    (work / "state").mkdir()
    src = build(a.tarball, work)
    data = work / "data"
    data.mkdir()
    (data / "hello.txt").write_text("hello\n")
    subprocess.run([*CLI, "prep", str(data), str(work / "dest"), "--quiet"], check=True, env=env)
    mnt = work / "mnt"
    mnt.mkdir()
    subprocess.run([*CLI, "mount", str(work / "dest"), str(mnt), "-o", "allow_other"],
                   check=True, env=env)
    results: dict[str, dict[str, object]] = {}
    try:
        wdir = mnt / "w"
        wdir.mkdir()
        os.chmod(wdir, 0o777)
        for name in a.dirs.split(","):
            if not (src / "tests" / name).is_dir():
                continue
            ok, planned, fails = run_dir(src / "tests", name, wdir, a.timeout)
            results[name] = {"ok": ok, "planned": planned, "failures": fails}
            print(f"{name:16s} {ok:5d} / {planned:5d}", flush=True)
    finally:
        subprocess.run([*CLI, "umount", str(mnt)], env=env, capture_output=True)
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
    tok = sum(int(r["ok"]) for r in results.values())  # type: ignore[call-overload]
    tpl = sum(int(r["planned"]) for r in results.values())  # type: ignore[call-overload]
    print(f"{'total':16s} {tok:5d} / {tpl:5d} ({100 * tok / max(tpl, 1):.1f}%)")
    if a.json:
        a.json.write_text(json.dumps({"total": {"ok": tok, "planned": tpl}, "dirs": results}, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
