"""What cp -a, tar and rsync -aH do to a tree with hard links, symlinks, fifos and empty
directories, on the writable part of a real mount: every client exits 0, the copies in the
mount and the staged-out tree match the source (names, types, modes, sizes, mtimes, link
targets, bytes, and which names share an inode); hard links, user.* xattrs, ctime and renames
of written files; across two ranks, a hard link, a symlink and user.* xattrs made on one rank
are read on the other, and stage-out keeps the link and the xattrs."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from _harness import prep_cli, run_cli

pytestmark = [pytest.mark.mount]


@pytest.fixture
def dest(src_tree: Path, tmp_path: Path) -> Path:
    return prep_cli(src_tree, tmp_path / "dest")


def _linked_tree(root: Path) -> Path:
    """Files (some with 2 or 3 names, one name in another directory), symlinks, fifos (one
    with two names) and empty directories, with fixed mtimes."""
    (root / "a" / "b").mkdir(parents=True)
    (root / "empty" / "deeper").mkdir(parents=True)
    (root / "lonely").mkdir()
    (root / "a" / "one.bin").write_bytes(os.urandom(70_000))
    os.link(root / "a" / "one.bin", root / "a" / "b" / "one-again.bin")
    os.link(root / "a" / "one.bin", root / "three.bin")
    (root / "a" / "two.txt").write_text("two names\n")
    os.link(root / "a" / "two.txt", root / "a" / "two-too.txt")
    (root / "solo.txt").write_text("only one name\n")
    os.chmod(root / "solo.txt", 0o640)
    os.symlink("one.bin", root / "a" / "rel-link")
    os.symlink("/nowhere", root / "dangling")
    os.mkfifo(root / "a" / "fifo", 0o600)
    os.link(root / "a" / "fifo", root / "fifo-too")
    for i, p in enumerate(sorted(root.rglob("*"), key=lambda p: -len(p.parts))):
        os.utime(p, ns=(1_600_000_000_000_000_000 + i, 1_600_000_000_123_456_789 + i * 1000),
                 follow_symlinks=False)
    return root


def _describe(root: Path) -> dict[str, tuple[object, ...]]:
    """Each name: type, mode, size (files), mtime, link target, bytes' hash, and the names
    sharing its inode."""
    groups: dict[int, list[str]] = {}
    stats = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        st = p.lstat()
        stats[rel] = (p, st)
        groups.setdefault(st.st_ino, []).append(rel)
    out: dict[str, tuple[object, ...]] = {}
    for rel, (p, st) in stats.items():
        kind = ("dir" if p.is_dir() and not p.is_symlink() else "link" if p.is_symlink()
                else "fifo" if p.is_fifo() else "file")
        out[rel] = (
            kind, st.st_mode & 0o7777 if kind != "link" else 0,
            st.st_size if kind in ("file", "link") else 0,
            st.st_mtime_ns if kind != "dir" else 0,  # a directory's changes with each copy
            os.readlink(p) if kind == "link" else "",
            hash(p.read_bytes()) if kind == "file" else 0,
            tuple(sorted(groups[st.st_ino])) if kind != "dir" else (),
        )
    return out


def _sh(cmd: str, cwd: Path | None = None) -> None:
    r = subprocess.run(cmd, shell=True, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{cmd!r} exited {r.returncode}: {r.stderr}"


def _need_rsync() -> str:
    if shutil.which("rsync") is None and os.geteuid() == 0:
        subprocess.run(["apt-get", "install", "-y", "-q", "rsync"], capture_output=True,
                       timeout=300)
    path = shutil.which("rsync")
    if path is None:
        pytest.skip("rsync is not installed (and cannot be installed here)")
    return path


@pytest.mark.timeout(240)
def test_cp_tar_rsync_keep_hard_links_and_stage_out(dest: Path, tmp_path: Path, mount_factory):
    """Each client copies into the mount and into a local directory: the two must match
    (GNU tar, even between local disks, makes a hard-linked fifo two fifos; cp -a and
    rsync -aH reproduce the source exactly)."""
    rsync = _need_rsync()
    src = _linked_tree(tmp_path / "tree")
    want = _describe(src)
    m = mount_factory(dest, local=str(tmp_path / "local"))
    refs = tmp_path / "refs"
    clients = {
        "cpa": "cp -a {src} {to}",
        "tarx": "mkdir {to} && tar -C {src} --format=posix -cf - . | tar -C {to} -xf -",
        "rs": rsync + " -aH {src}/ {to}/",
    }
    expect = {}
    for name, cmd in clients.items():
        refs.mkdir(exist_ok=True)
        _sh(cmd.format(src=src, to=refs / name))
        expect[name] = _describe(refs / name)
        _sh(cmd.format(src=src, to=m.path / name))
    assert expect["cpa"] == expect["rs"] == want
    for name in clients:
        assert _describe(m.path / name) == expect[name], name
    out = tmp_path / "out"
    r = run_cli("umount", m.template, "--stage-out", out, env=m.env)
    m.umount_result = r
    for name in clients:
        assert _describe(out / name) == expect[name], name


@pytest.mark.timeout(120)
def test_links_xattrs_ctime_and_renames_in_the_mount(dest: Path, tmp_path: Path,
                                                     mount_factory):
    m = mount_factory(dest, local=str(tmp_path / "local"))
    ds = m.path
    p = ds / "w"
    p.mkdir()
    (p / "a").write_bytes(b"first")
    os.link(p / "a", p / "b")
    assert (p / "a").stat().st_nlink == 2 and (p / "a").stat().st_ino == (p / "b").stat().st_ino
    with open(p / "b", "ab") as f:  # write through one name, read through the other
        f.write(b" second")
    assert (p / "a").read_bytes() == b"first second"
    os.unlink(p / "a")
    assert (p / "b").stat().st_nlink == 1 and (p / "b").read_bytes() == b"first second"
    with pytest.raises(OSError) as ei:
        os.link(ds / "classes", p / "x")  # a directory: EPERM (the kernel's answer)
    assert ei.value.errno == errno.EPERM
    os.link(p / "b", ds / "classes" / "y")  # a written file, another name in a dataset dir
    assert (ds / "classes" / "y").read_bytes() == b"first second"
    os.unlink(ds / "classes" / "y")
    ds_file = next(q for q in (ds / "classes").rglob("*") if q.is_file())
    with pytest.raises(OSError) as ei:
        os.link(ds_file, p / "ds-link")
    assert ei.value.errno == errno.EXDEV
    # ctime is its own field: chmod moves it, not the mtime
    os.utime(p / "b", ns=(1_000_000_000, 2_000_000_000))
    before = (p / "b").stat()
    time.sleep(0.02)
    os.chmod(p / "b", 0o600)
    after = (p / "b").stat()
    assert (after.st_atime_ns, after.st_mtime_ns) == (1_000_000_000, 2_000_000_000)
    assert after.st_ctime_ns > before.st_ctime_ns
    # user.* xattrs
    os.setxattr(p / "b", "user.note", b"kept")
    assert os.getxattr(p / "b", "user.note") == b"kept"
    assert "user.note" in os.listxattr(p / "b")
    os.setxattr(p / "b", "user.gone", b"1")
    os.removexattr(p / "b", "user.gone")
    with pytest.raises(OSError) as ei:
        os.getxattr(p / "b", "user.gone")
    assert ei.value.errno == errno.ENODATA
    # a just-written file renamed at once (the temp-file-then-rename pattern), many times
    (p / "pyc").mkdir()
    t0 = time.monotonic()
    for i in range(200):
        tmp = p / "pyc" / f"m{i}.pyc.{os.getpid()}"
        tmp.write_bytes(b"%d" % i * 100)
        os.rename(tmp, p / "pyc" / f"m{i}.pyc")
    took = time.monotonic() - t0
    out = tmp_path / "out"
    r = run_cli("umount", m.template, "--stage-out", out, env=m.env)
    m.umount_result = r
    out = out / "w"
    assert (out / "b").read_bytes() == b"first second"
    assert os.getxattr(out / "b", "user.note") == b"kept"
    assert sorted(os.listdir(out / "pyc")) == sorted(f"m{i}.pyc" for i in range(200))
    assert all((out / "pyc" / f"m{i}.pyc").read_bytes() == b"%d" % i * 100 for i in range(200))
    assert took < 60, f"200 write+rename took {took:.1f} s"


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_links_symlinks_and_xattrs_across_two_ranks(dest: Path, tmp_path: Path, mount_factory):
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=2,
                      local=str(tmp_path / "local" / "{rank}"))
    r0, r1 = (Path(mp) for mp in m.mountpoints)
    body = os.urandom(200_000)
    (r1 / "d").mkdir()
    (r1 / "d" / "orig").write_bytes(body)
    os.link(r1 / "d" / "orig", r1 / "d" / "other")
    os.symlink("orig", r1 / "d" / "sym")
    assert (r0 / "d" / "other").read_bytes() == body  # close-to-open, through the new name
    assert os.readlink(r0 / "d" / "sym") == "orig"
    assert (r0 / "d" / "sym").read_bytes() == body
    with open(r1 / "d" / "orig", "r+b") as f:  # changed through one name on rank 1...
        f.write(b"CHANGED")
    assert (r0 / "d" / "other").read_bytes() == b"CHANGED" + body[7:]  # ...read via the other
    with pytest.raises(OSError) as ei:  # another rank's file: EXDEV (cp copies instead)
        os.link(r1 / "d" / "orig", r0 / "d" / "mine")
    assert ei.value.errno == errno.EXDEV
    os.rename(r1 / "d" / "other", r1 / "d" / "renamed")
    assert (r0 / "d" / "renamed").read_bytes() == b"CHANGED" + body[7:]
    # user.* xattrs set on rank 1 (a file, a directory) are read on rank 0, removals too
    os.setxattr(r1 / "d" / "orig", "user.note", b"from rank 1")
    os.setxattr(r1 / "d" / "orig", "user.gone", b"x")
    os.setxattr(r1 / "d", "user.dir", b"d")
    assert os.getxattr(r0 / "d" / "orig", "user.note") == b"from rank 1"
    assert sorted(os.listxattr(r0 / "d" / "orig")) == ["user.gone", "user.note"]
    assert os.getxattr(r0 / "d", "user.dir") == b"d"
    os.removexattr(r1 / "d" / "orig", "user.gone")
    assert os.listxattr(r0 / "d" / "orig") == ["user.note"]
    with pytest.raises(OSError) as ei:
        os.getxattr(r0 / "d" / "orig", "user.gone")
    assert ei.value.errno == errno.ENODATA
    with open(r1 / "d" / "orig", "r+b") as f:  # set while the file is changed: its commit publishes
        f.write(b"AGAIN!!")
        os.setxattr(f.fileno(), "user.note", b"while dirty")
    assert os.getxattr(r0 / "d" / "orig", "user.note") == b"while dirty"
    assert (r0 / "d" / "renamed").read_bytes() == b"AGAIN!!" + body[7:]
    with pytest.raises(OSError) as ei:  # another rank's entry: EPERM
        os.setxattr(r0 / "d" / "orig", "user.mine", b"no")
    assert ei.value.errno == errno.EPERM
    out = tmp_path / "out"
    r = run_cli("umount", m.template, "--stage-out", out, env=m.env)
    m.umount_result = r
    assert (out / "d" / "orig").stat().st_ino == (out / "d" / "renamed").stat().st_ino
    assert (out / "d" / "renamed").read_bytes() == b"AGAIN!!" + body[7:]
    assert os.readlink(out / "d" / "sym") == "orig"
    assert os.getxattr(out / "d" / "renamed", "user.note") == b"while dirty"
    assert os.getxattr(out / "d", "user.dir") == b"d"
