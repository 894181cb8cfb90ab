"""Files open without OPEN (the default with the patched pyfuse3, `_fuse_ops.PATCHED`): the
first OPEN is answered ENOSYS, after which the kernel opens every regular file without asking
the daemon (no OPEN, no RELEASE; FLUSH answered ENOSYS once, then never sent). Dataset reads,
written files (created, appended, overwritten, truncated, unlinked while open) and close-to-open
across ranks must all keep their bytes, checked against what was written."""

from __future__ import annotations

import errno
import mmap
import os
import re
import stat
import time
from pathlib import Path

import pytest
from _harness import first_write_errno, prep_cli, run_cli, status_ranks

pytestmark = [pytest.mark.mount]


def _need_shim() -> None:
    from fanstore_fuse._fuse_ops import PATCHED

    if not PATCHED:
        pytest.fail("pyfuse3 lacks the fanstore patch (bash scripts/install-pyfuse3.sh .venv/bin/python)")


def _tree(src: Path) -> dict[str, bytes]:
    files = {f"d/f{i:02d}": os.urandom(3000 + 997 * i) for i in range(12)}
    for rel, body in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(body)
    return files


def _two_ranks(tmp_path: Path, mount_factory):
    """A 2-rank mount of `_tree`: (the mount, rank 0's mountpoint, rank 1's)."""
    _need_shim()
    src = tmp_path / "src"
    _tree(src)
    dest = prep_cli(src, tmp_path / "dest")
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=2,
                      local=str(tmp_path / "local" / "{rank}"))
    r0, r1 = (Path(mp) for mp in m.mountpoints)
    return m, r0, r1


def _opcodes(m) -> list[str]:
    return re.findall(r"opcode: (OPEN|FLUSH|RELEASE|CREATE) ", m.log_text())


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


@pytest.mark.timeout(120)
def test_files_open_without_requests_and_keep_their_bytes(tmp_path: Path, mount_factory):
    """One rank: dataset reads send one OPEN (ENOSYS) and at most one FLUSH in all, and no
    RELEASE; a dataset file opened for writing fails at the write (EROFS) or, truncated, at the
    open; written files keep every change, also one unlinked while open; stage-out has them."""
    _need_shim()
    src = tmp_path / "src"
    files = _tree(src)
    dest = prep_cli(src, tmp_path / "dest")
    m = mount_factory(dest, local=str(tmp_path / "local"), extra_args=["--debug"])
    p = m.path
    for _ in range(3):
        for rel, body in files.items():
            assert (p / rel).read_bytes() == body, rel
    ops = _opcodes(m)
    assert ops.count("OPEN") == 1 and ops.count("FLUSH") <= 1 and "RELEASE" not in ops, ops
    stats = status_ranks(m.status())[0]["stats"]
    assert stats["opens_refused"] == 1 and stats.get("opens", 0) == 0, stats
    # the dataset stays read-only
    assert first_write_errno(p / "d" / "f03") == errno.EROFS
    with pytest.raises(OSError) as ei:
        open(p / "d" / "f03", "wb")
    assert ei.value.errno == errno.EROFS
    assert (p / "d" / "f03").read_bytes() == files["d/f03"]
    # written files: create, append, overwrite in place, truncate, read back
    (p / "out").mkdir()
    log = p / "out" / "train.log"
    text = b""
    for step in range(4):
        with open(log, "ab") as f:  # the first creates (CREATE); the others open without OPEN
            f.write(b"step %d\n" % step)
        text += b"step %d\n" % step
        assert log.read_bytes() == text
    with open(log, "r+b") as f:
        f.seek(5)
        f.write(b"X")
    text = text[:5] + b"X" + text[6:]
    assert log.read_bytes() == text
    with open(log, "wb") as f:  # O_TRUNC: a SETATTR (no atomic O_TRUNC without OPEN)
        f.write(b"fresh\n")
    assert log.read_bytes() == b"fresh\n"
    os.truncate(log, 3)
    assert log.read_bytes() == b"fre"
    # unlinked while open (opened without OPEN): still readable through that open file
    keep = p / "out" / "keep.bin"
    body = os.urandom(200_000)
    keep.write_bytes(body)
    with open(keep, "rb") as f:
        os.unlink(keep)
        assert not keep.exists()
        assert f.read() == body
    ops = _opcodes(m)
    assert ops.count("OPEN") == 1 and ops.count("FLUSH") <= 1, ops
    out = tmp_path / "staged"
    r = run_cli("umount", m.template, "--stage-out", out, env=m.env)
    m.umount_result = r
    assert _tree_bytes(out) == {"out/train.log": b"fre"}


@pytest.mark.timeout(120)
def test_the_first_open_comes_from_a_child_not_from_the_daemon(tmp_path: Path, mount_factory):
    """The daemon has the kernel take `no_open` by opening one dataset file through its own
    mount as soon as it serves. That open must come from a child process: a thread of the
    daemon waiting on its own mount when the daemon is SIGKILLed never returns, so the daemon
    never exits and its mount hangs (seen in CI, test_stale_mount_after_sigkill). Then a
    SIGKILLed daemon is gone at once and its mount answers ENOTCONN."""
    _need_shim()
    src = tmp_path / "src"
    _tree(src)
    dest = prep_cli(src, tmp_path / "dest")
    m = mount_factory(dest, local=str(tmp_path / "local"), extra_args=["--debug"])
    deadline = time.monotonic() + 30
    while status_ranks(m.status())[0]["stats"].get("opens_refused", 0) < 1:  # the first OPEN came
        assert time.monotonic() < deadline, "no OPEN reached the daemon"
        time.sleep(0.05)
    daemons = [p for p in m.pids() if os.path.exists(f"/proc/{p}")]
    tids = {int(t) for p in daemons for t in os.listdir(f"/proc/{p}/task")} | set(daemons)
    opens = [int(pid) for pid in re.findall(r"opcode: OPEN \(14\).*? pid: (\d+)", m.log_text())]
    assert len(opens) == 1 and opens[0] not in tids, (opens, sorted(tids))
    for p in daemons:
        os.kill(p, 9)
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") for p in daemons):
        assert time.monotonic() < deadline, "a SIGKILLed daemon did not exit"
        time.sleep(0.05)
    with pytest.raises(OSError) as ei:
        (m.path / "d" / "f01").read_bytes()
    assert ei.value.errno in (errno.ENOTCONN, errno.ECONNABORTED), ei.value


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_close_to_open_across_ranks_without_flush(tmp_path: Path, mount_factory):
    """Rank 1 writes; right after each close(2), rank 0 reads the new bytes: a new file, one
    rewritten in place with the same size (rank 0 had its old pages cached), appended, and
    truncated and rewritten shorter. No FLUSH is needed: rank 0's lookup asks the writer."""
    m, r0, r1 = _two_ranks(tmp_path, mount_factory)
    f1, f0 = r1 / "ckpt.bin", r0 / "ckpt.bin"
    a = os.urandom(300_000)
    f1.write_bytes(a)
    assert f0.read_bytes() == a
    assert f0.read_bytes() == a  # cached on rank 0 now
    b = os.urandom(len(a))
    with open(f1, "r+b") as f:  # same size, opened without OPEN: its first write tells
        f.write(b)
    assert f0.stat().st_size == len(b)
    assert f0.read_bytes() == b
    with open(f1, "ab") as f:
        f.write(b"tail")
    assert f0.read_bytes() == b + b"tail"
    with open(f1, "wb") as f:
        f.write(b"short")
    assert f0.read_bytes() == b"short"
    time.sleep(0.5)  # rank 1's idle commit done or not: either way the same bytes
    assert f0.read_bytes() == b"short"
    # entries without data (a symlink, a fifo) are looked up elsewhere without asking the writer
    os.symlink("ckpt.bin", r1 / "link")
    os.mkfifo(r1 / "fifo")
    assert os.path.islink(r0 / "link") and stat.S_ISFIFO(os.lstat(r0 / "fifo").st_mode)
    out = tmp_path / "staged"
    r = run_cli("umount", m.template, "--stage-out", out, env=m.env)
    m.umount_result = r
    assert _tree_bytes(out) == {"ckpt.bin": b"short"}


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_a_file_written_through_a_shared_mapping_keeps_its_bytes(tmp_path: Path, mount_factory):
    """Writes through a MAP_SHARED mapping (np.memmap 'w+' / 'r+') reach the daemon as WRITEs
    with handle 0 (written back from the page cache, no OPEN behind them): rank 1 fills a
    new file through a mapping, then changes it in place through another (msync); rank 0
    reads each version after the writer's close and munmap, and stage-out has the last."""
    m, r0, r1 = _two_ranks(tmp_path, mount_factory)
    n = 3 * 4096 + 100
    body = os.urandom(n)
    fd = os.open(r1 / "mm.bin", os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(fd, n)
    mm = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    mm[:] = body
    mm.close()
    os.close(fd)  # close(2) writes the dirty pages back before it returns
    assert (r1 / "mm.bin").read_bytes() == body
    assert (r0 / "mm.bin").read_bytes() == body
    fd = os.open(r1 / "mm.bin", os.O_RDWR)
    mm = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)  # the mapping outlives the descriptor
    mm[4090:4110] = b"0123456789" * 2  # across a page boundary
    body = body[:4090] + b"0123456789" * 2 + body[4110:]
    mm.flush()  # msync(MS_SYNC): written back now
    mm.close()
    assert (r1 / "mm.bin").read_bytes() == body
    assert (r0 / "mm.bin").read_bytes() == body
    out = tmp_path / "staged"
    r = run_cli("umount", m.template, "--stage-out", out, env=m.env)
    m.umount_result = r
    assert _tree_bytes(out) == {"mm.bin": body}


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_a_big_file_changed_in_one_chunk_is_read_right_on_the_other_rank(tmp_path: Path,
                                                                         mount_factory):
    """A 9 MiB file (three 4 MiB chunks) written on rank 1 and read on rank 0, then changed in
    place in its middle chunk only: that commit hashes the middle chunk again and keeps the
    other two digests. Rank 0 reads every chunk from rank 1 checked against those digests,
    and stage-out checks the file's digest: the new bytes everywhere."""
    m, r0, r1 = _two_ranks(tmp_path, mount_factory)
    body = bytearray(os.urandom(9 << 20))
    (r1 / "big.bin").write_bytes(body)
    assert (r0 / "big.bin").read_bytes() == body
    with open(r1 / "big.bin", "r+b") as f:
        f.seek((4 << 20) + 12345)
        f.write(b"changed in the middle chunk")
    body[(4 << 20) + 12345:(4 << 20) + 12345 + 27] = b"changed in the middle chunk"
    assert (r0 / "big.bin").read_bytes() == body
    time.sleep(0.5)  # the idle commit on rank 1, for stage-out
    out = tmp_path / "staged"
    r = run_cli("umount", m.template, "--stage-out", out, env=m.env)
    m.umount_result = r
    assert _tree_bytes(out) == {"big.bin": bytes(body)}
