"""Listings: a directory of 2,500 entries listed whole, plain READDIR for a traversal that only
lists (find), READDIRPLUS for a walk that stats (few LOOKUPs reach the daemon), written entries
still listed after the dataset's. Real mounts, compared with the source tree."""

from __future__ import annotations

import json
import os
import re
import stat
import time
from pathlib import Path

import pytest
from _harness import mounted, prep_cli, status_ranks

from fanstore_fuse._ring import Placement

pytestmark = [pytest.mark.mount]

BIG = 2500  # entries of the big directory: its plain listing takes more than one 4 KiB page


def _tree(root: Path) -> None:
    (root / "big").mkdir(parents=True)
    for i in range(BIG):
        (root / "big" / f"img_{i:05d}.JPEG").write_bytes(bytes([i % 251]) * (i % 700))
    for d in range(4):
        sub = root / "walk" / f"d{d}"
        sub.mkdir(parents=True)
        for i in range(300):
            (sub / f"f{i:03d}").write_bytes(b"w" * i)
    (root / "mixed" / "sub" / "deeper").mkdir(parents=True)
    (root / "mixed" / "file").write_bytes(b"data")
    (root / "mixed" / "sub" / "x").write_bytes(b"x" * 10_000)
    os.symlink("file", root / "mixed" / "link")
    os.symlink("../big/img_00001.JPEG", root / "mixed" / "sub" / "up")
    os.chmod(root / "mixed" / "file", 0o640)
    os.utime(root / "mixed" / "file", ns=(1_500_000_000_123_456_789, 1_500_000_000_123_456_789))


@pytest.fixture
def prepped(tmp_path) -> tuple[Path, Path]:
    """(source tree, its prepped DEST)."""
    _tree(tmp_path / "src")
    return tmp_path / "src", prep_cli(tmp_path / "src", tmp_path / "dest")


def _scan(root: str) -> list[tuple[str, str]]:
    """(relative path, type from d_type) of every entry under root, sorted."""
    out: list[tuple[str, str]] = []
    stack = [root]
    while stack:
        top = stack.pop()
        with os.scandir(top) as it:
            for e in it:
                kind = "l" if e.is_symlink() else "d" if e.is_dir(follow_symlinks=False) else "f"
                out.append((os.path.relpath(e.path, root), kind))
                if kind == "d":
                    stack.append(e.path)
    return sorted(out)


def _attrs(root: str, rel: str) -> tuple[int, ...]:
    st = os.lstat(os.path.join(root, rel))
    nlink = st.st_nlink if stat.S_ISDIR(st.st_mode) else 1
    size = st.st_size if not stat.S_ISDIR(st.st_mode) else 0  # ext4 and prep differ for dirs
    return (st.st_mode, size, st.st_mtime_ns, st.st_uid, st.st_gid, nlink)


def _same_as_source(src: Path, mp: str) -> None:
    names = _scan(os.fspath(src))
    assert _scan(mp) == names  # names and d_type
    for rel, kind in names:  # stat after listing: each a LOOKUP or a READDIRPLUS entry
        assert _attrs(mp, rel) == _attrs(os.fspath(src), rel), rel
        if kind == "l":
            assert os.readlink(os.path.join(mp, rel)) == os.readlink(src / rel)
    assert (Path(mp) / "mixed" / "sub" / "x").read_bytes() == b"x" * 10_000


def _ops(m, inode: int | None = None) -> dict[str, int]:
    """FUSE opcodes in the daemons' debug log so far (of one node id when given)."""
    node = rf"nodeid: {inode}," if inode is not None else r"nodeid: \d+,"
    found = re.findall(rf"opcode: ([A-Z]+) \(\d+\), {node}", m.log_text())
    return {op: found.count(op) for op in set(found)}


@pytest.mark.timeout(240)
def test_a_walk_gets_attributes_with_the_listing(tmp_path, state_dir, prepped):
    src, dest = prepped
    with mounted(dest, tmp_path / "mnt", state_dir, local=tmp_path / "local",
                 extra_args=["--debug"]) as m:
        mp = os.fspath(m.path)
        big = os.lstat(os.path.join(mp, "big")).st_ino  # looks up a directory only
        with os.scandir(os.path.join(mp, "big")) as it:  # names and types only, as find
            listed = sorted((e.name, e.inode(), e.is_dir(follow_symlinks=False)) for e in it)
        assert [(n, d) for n, _, d in listed] == sorted(
            (e.name, e.is_dir(follow_symlinks=False)) for e in os.scandir(src / "big"))
        # one entry with attributes, the rest plainly (no inode per entry in the kernel)
        ops = _ops(m, big)
        assert ops.get("READDIRPLUS", 0) == 1 and ops.get("READDIR", 0) >= 1, ops
        lookups = _ops(m).get("LOOKUP", 0)
        name, ino, _ = listed[-1]
        assert os.lstat(os.path.join(mp, "big", name)).st_ino == ino  # listed plainly: a LOOKUP
        assert _ops(m).get("LOOKUP", 0) == lookups + 1

        # a walk that stats every file: after the first directory, every entry comes with its
        # attributes (all but the last of every eighth directory), so few LOOKUPs reach the
        # daemon
        before = _ops(m).get("LOOKUP", 0)
        n = 0
        for top, _dirs, files in os.walk(os.path.join(mp, "walk")):
            for f in files:
                os.lstat(os.path.join(top, f))
                n += 1
        assert n == 1200
        lookups = _ops(m).get("LOOKUP", 0) - before
        assert lookups <= 300 + 4 + 3, lookups  # d0's files, the dirs, a probe's file

        _same_as_source(src, mp)

        # written entries follow the dataset's in a dataset directory's listing
        (m.path / "big" / "zz_written.txt").write_bytes(b"new")
        (m.path / "big" / "a_written_dir").mkdir()
        got = {e.name: e.is_dir() for e in os.scandir(m.path / "big")}
        assert len(got) == BIG + 2 and got["a_written_dir"] and not got["zz_written.txt"]
        assert (m.path / "big" / "zz_written.txt").read_bytes() == b"new"
        assert "Traceback" not in m.log_text()


@pytest.mark.timeout(300)
def test_listings_and_attributes_on_three_ranks(tmp_path, state_dir, prepped):
    src, dest = prepped
    with mounted(dest, tmp_path / "mnt-{rank}", state_dir, local=tmp_path / "local-{rank}",
                 ranks=3) as m:
        for mp in m.mountpoints[:2]:
            _same_as_source(src, mp)
        # again, on every rank (after warm-up every rank answers from its own map)
        for mp in m.mountpoints:
            _same_as_source(src, mp)
        with open(os.path.join(m.mountpoints[1], "walk", "d1", "late.txt"), "wb") as f:
            f.write(b"from rank 1")
        names = os.listdir(os.path.join(m.mountpoints[0], "walk", "d1"))
        assert len(names) == 301 and "late.txt" in names
        assert "Traceback" not in m.log_text()


def test_a_directory_nobody_wrote_in_is_listed_without_asking_its_owner(tmp_path, state_dir,
                                                                       prepped):
    """On a writable mount, a rank lists a dataset directory it does not own without asking
    the owner for written entries until some rank writes in it: the owner tells every rank
    before that first create returns, and from then on every rank's listing asks it."""
    src, dest = prepped
    with mounted(dest, tmp_path / "mnt-{rank}", state_dir, local=tmp_path / "local-{rank}",
                 ranks=3) as m:
        mps = m.mountpoints

        def inline() -> list[int]:  # requests answered on each rank's MPI thread (listings')
            data = json.loads(os.getxattr(mps[0], "user.fanstore.status"))
            return [r["mpi_served_inline"] for r in status_ranks(data)]

        before, deadline = inline(), time.monotonic() + 10
        while time.monotonic() < deadline:  # the start-up's own reads are over
            time.sleep(0.5)
            now = inline()
            if now == before:
                break
            before = now
        dirs = [f"walk/d{d}" for d in range(4)]
        for mp in mps:
            for d in dirs:
                assert sorted(os.listdir(os.path.join(mp, d))) == sorted(os.listdir(src / d))
        assert inline() == before
        d = "walk/d2"
        owner = Placement(3, 1).locate_metadata(d.encode())
        writer = (owner + 1) % 3
        with open(os.path.join(mps[writer], d, "new.txt"), "wb") as f:
            f.write(b"written on one rank")
        for mp in mps:
            assert sorted(os.listdir(os.path.join(mp, d))) == sorted([*os.listdir(src / d),
                                                                      "new.txt"])
        assert inline()[owner] > before[owner]  # the other ranks asked it
        assert "Traceback" not in m.log_text()

