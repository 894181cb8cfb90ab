"""FOPEN_NOFLUSH: on a writable mount that answers OPEN (`FANSTORE_NO_OPEN=0`), closing a file
opened read-only sends no FUSE FLUSH; closing a written file still does, and commits it
(close-to-open). Without OPEN (the default) no FLUSH is sent at all: tests/test_no_open.py."""

from __future__ import annotations

import importlib.util
import os
import re
import time

import pytest
from _harness import mounted, prep_cli

pytestmark = [pytest.mark.mount]


def _ops_until(m, done, timeout: float = 20.0) -> list[str]:
    """The FUSE opcodes of interest in the daemon's debug log, once `done(ops)` or at timeout."""
    deadline = time.monotonic() + timeout
    while True:
        ops = re.findall(r"opcode: (OPEN|FLUSH|RELEASE|CREATE) ", m.log_text())
        if done(ops) or time.monotonic() > deadline:
            return ops
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_read_only_opens_are_not_flushed_written_files_are(tmp_path, state_dir):
    if importlib.util.find_spec("fanstore_fuse._noflush") is None:
        pytest.fail("the _noflush shim is not built (pip install -e . needs fuse3 headers and cc)")
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    data = {f"f{i}": bytes([i]) * (5000 + i) for i in range(3)}
    for name, body in data.items():
        (src / "d" / name).write_bytes(body)
    dest = prep_cli(src, tmp_path / "dest")
    with mounted(dest, tmp_path / "mnt", state_dir, local=tmp_path / "local",
                 extra_args=["--debug"], env={"FANSTORE_NO_OPEN": "0"}) as m:  # OPEN answered
        for name, body in data.items():
            assert (m.path / "d" / name).read_bytes() == body
        ops = _ops_until(m, lambda ops: ops.count("RELEASE") >= 3)  # RELEASE is asynchronous
        assert ops.count("OPEN") >= 3 and ops.count("RELEASE") >= 3, ops
        assert "FLUSH" not in ops, ops
        (m.path / "new.txt").write_bytes(b"written")
        assert (m.path / "new.txt").read_bytes() == b"written"
        ops = _ops_until(m, lambda ops: ops.count("RELEASE") >= 5)
        assert "CREATE" in ops and "FLUSH" in ops, ops
        assert ops[ops.index("CREATE"):].count("FLUSH") >= 1
        assert "FUSE operations patched by the C shim: True" in m.log_text()


def _readdirs(m, inode: int) -> int:
    """READDIRPLUS requests for directory `inode` in the daemons' FUSE debug log so far."""
    return len(re.findall(rf"opcode: READDIRPLUS \(44\), nodeid: {inode},", m.log_text()))


@pytest.mark.timeout(120)
def test_dataset_listings_are_cached_by_the_kernel_written_dirs_are_not(tmp_path, state_dir):
    """FOPEN_CACHE_DIR on opendir of a dataset directory: a second listing is answered from the
    kernel's cache (no READDIRPLUS reaches the daemon). A directory holding a written entry is
    not cached: every listing asks the daemon, and the new name is listed at once."""
    if importlib.util.find_spec("fanstore_fuse._noflush") is None:
        pytest.fail("the _noflush shim is not built (pip install -e . needs fuse3 headers and cc)")
    src = tmp_path / "src"
    for d in ("a", "b"):
        (src / d).mkdir(parents=True)
        for i in range(300):
            (src / d / f"f{i:03d}").write_bytes(b"x" * i)
    dest = prep_cli(src, tmp_path / "dest")
    with mounted(dest, tmp_path / "mnt", state_dir, local=tmp_path / "local",
                 extra_args=["--debug"]) as m:
        a, b = m.path / "a", m.path / "b"
        want = sorted(f"f{i:03d}" for i in range(300))
        assert sorted(os.listdir(a)) == want
        first = _readdirs(m, a.stat().st_ino)
        assert first >= 1
        assert sorted(os.listdir(a)) == want
        assert _readdirs(m, a.stat().st_ino) == first  # from the kernel's cache
        (b / "new.txt").write_bytes(b"written")
        for _ in range(2):
            before = _readdirs(m, b.stat().st_ino)
            assert sorted(os.listdir(b)) == sorted([*want, "new.txt"])
            assert _readdirs(m, b.stat().st_ino) > before  # asked every time


@pytest.mark.timeout(180)
def test_cached_listing_shows_a_file_another_rank_wrote(tmp_path, state_dir):
    """Rank 0 lists a dataset directory (cached by its kernel); rank 1 writes a file into it;
    rank 0's next listing has the new name (its opendir asks the directory's owner for written
    entries, so the cache is dropped)."""
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    for i in range(50):
        (src / "d" / f"f{i:02d}").write_bytes(b"y" * i)
    dest = prep_cli(src, tmp_path / "dest")
    with mounted(dest, tmp_path / "mnt-{rank}", state_dir, local=tmp_path / "local-{rank}",
                 ranks=3) as m:
        mp0, mp1 = m.mountpoints[0], m.mountpoints[1]
        want = sorted(f"f{i:02d}" for i in range(50))
        assert sorted(os.listdir(os.path.join(mp0, "d"))) == want
        assert sorted(os.listdir(os.path.join(mp0, "d"))) == want
        with open(os.path.join(mp1, "d", "late.txt"), "wb") as f:
            f.write(b"from rank 1")
        assert sorted(os.listdir(os.path.join(mp0, "d"))) == sorted([*want, "late.txt"])
        with open(os.path.join(mp0, "d", "late.txt"), "rb") as f:
            assert f.read() == b"from rank 1"
