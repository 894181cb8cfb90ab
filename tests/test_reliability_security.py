"""Faults, 5. what other users of the node can see: a private mount by default, permissions
enforced with allow_other, the status xattr guarded, nothing written outside the local and state
dirs.

Each test states the expected outcome in its docstring and asserts it; docs/reliability.md
describes them.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from _harness import cli_env, fuse_mounts, mounted, run_cli
from _reliability_helpers import WIDE

from fanstore_fuse import PrepOptions, prep

pytestmark = pytest.mark.fault


NOBODY = 65534


def _as_nobody(fn) -> int:
    """Run fn() in a forked child as uid/gid 65534; return 0 or the errno it raised."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 0
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            fn()
        except OSError as e:
            code = e.errno or 255
        except BaseException:
            code = 254
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _mount_options(mp: str) -> set[str]:
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if fields[1] == mp:
                return set(fields[3].split(","))
    raise AssertionError(f"{mp} not mounted")


@pytest.fixture
def public_dir():
    """A world-traversable directory (pytest's tmp dirs are 0700: another uid would get EACCES
    there before ever reaching the mount)."""
    d = tempfile.mkdtemp(prefix="fanstore-sec-", dir="/tmp")
    os.chmod(d, 0o755)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def _tree_state(root: Path) -> dict[str, tuple]:
    out = {}
    for dp, dns, fns in os.walk(root):
        for n in dns + fns:
            p = os.path.join(dp, n)
            s = os.lstat(p)
            out[os.path.relpath(p, root)] = (s.st_mode, s.st_size, s.st_mtime_ns)
    return out


def _permission_tree(public_dir: Path) -> Path:
    """A world-readable file and an owner-only one, in a directory everyone may enter."""
    src = public_dir / "src"
    src.mkdir()
    os.chmod(src, 0o755)
    (src / "public.txt").write_bytes(b"world readable\n")
    os.chmod(src / "public.txt", 0o644)
    (src / "secret.txt").write_bytes(b"owner only\n")
    os.chmod(src / "secret.txt", 0o600)
    return src


@pytest.mark.mount
@pytest.mark.timeout(120)
def test_mount_is_private_and_writes_nowhere_else(public_dir: Path, tmp_path: Path):
    """Default mount: no allow_other, default_permissions, nosuid, nodev; uid 65534 gets EACCES
    for stat, read and the status xattr; set[ug]id bits from the source never appear; nothing is
    written outside the local and state dirs (DEST, SRC and TMPDIR unchanged afterwards)."""
    src = _permission_tree(public_dir)
    (src / "suid").write_bytes(b"#!/bin/sh\n")
    os.chmod(src / "suid", 0o6755)
    dest = public_dir / "dest"
    prep(src, dest, PrepOptions(partitions=1, workers=1))
    tmpdir = public_dir / "tmp"
    tmpdir.mkdir()
    state = public_dir / "state"
    env = cli_env(state, TMPDIR=str(tmpdir), **WIDE)
    before = {d: _tree_state(d) for d in (src, dest, tmpdir)}
    mp = public_dir / "mp"
    mp.mkdir()
    os.chmod(mp, 0o755)
    run_cli("mount", dest, mp, env=env)
    try:
        opts = _mount_options(str(mp))
        assert "allow_other" not in opts and "default_permissions" in opts, opts
        assert {"nosuid", "nodev"} <= opts, opts
        assert os.stat(mp / "suid").st_mode & 0o7777 == 0o755
        assert _as_nobody(lambda: os.stat(public_dir)) == 0  # the way there is open ...
        assert _as_nobody(lambda: os.stat(mp)) == errno.EACCES  # ... the mount is not
        assert _as_nobody(lambda: open(mp / "public.txt", "rb").read()) == errno.EACCES
        assert _as_nobody(lambda: os.getxattr(mp, "user.fanstore.status")) == errno.EACCES
        assert (mp / "public.txt").read_bytes() == b"world readable\n"
        assert json.loads(os.getxattr(mp, "user.fanstore.status"))
        # Only the default local dir (under TMPDIR) and the state dir were written.
        during = _tree_state(tmpdir)
        assert all(p.startswith(f"fanstore-fuse-{os.getuid()}") for p in during), sorted(during)
    finally:
        run_cli("umount", mp, env=env, check=False)
        if str(mp) in fuse_mounts():
            subprocess.run(["fusermount3", "-u", "-z", str(mp)])
    assert str(mp) not in fuse_mounts()
    assert os.listdir(mp) == []
    after = {d: _tree_state(d) for d in (src, dest, tmpdir)}
    leftover = {p for p in after[tmpdir] if p not in before[tmpdir]}
    # An empty per-user directory may stay (it holds default local dirs); nothing in it.
    assert all(not os.listdir(tmpdir / p) for p in leftover if (tmpdir / p).is_dir()), leftover
    assert after[src] == before[src] and after[dest] == before[dest]
    assert not [p for p in os.listdir(state) if not p.endswith(".log")], os.listdir(state)


@pytest.mark.mount
@pytest.mark.timeout(120)
def test_allow_other_still_enforces_permissions_and_guards_status(public_dir: Path, tmp_path: Path):
    """With -o allow_other: uid 65534 reads a 0644 file, gets EACCES on a 0600 file
    (default_permissions) and on the status xattr; listxattr on the root hides it from them."""
    src = _permission_tree(public_dir)
    dest = public_dir / "dest"
    prep(src, dest, PrepOptions(partitions=1, workers=1))
    state = tmp_path / "state"
    mp = public_dir / "mp"
    with mounted(dest, mp, state, local=tmp_path / "local", extra_args=["-o", "allow_other"]) as m:
        assert "allow_other" in _mount_options(str(mp))

        def read_public() -> None:
            if open(mp / "public.txt", "rb").read() != b"world readable\n":
                raise OSError(errno.EBADMSG, "wrong bytes")

        def list_status() -> None:
            if any("status" in n for n in os.listxattr(mp)):
                raise OSError(errno.EEXIST, "status listed")

        assert _as_nobody(read_public) == 0
        assert _as_nobody(lambda: open(mp / "secret.txt", "rb").read()) == errno.EACCES
        assert _as_nobody(lambda: os.getxattr(mp, "user.fanstore.status")) in (errno.EACCES,
                                                                                errno.EPERM)
        assert _as_nobody(list_status) == 0
        assert _as_nobody(lambda: open(mp / "public.txt", "r+b")) in (errno.EROFS, errno.EACCES)
        assert json.loads(os.getxattr(mp, "user.fanstore.status"))
        m.umount()
    assert m.forced == []
