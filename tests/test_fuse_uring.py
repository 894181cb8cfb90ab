"""FUSE over io_uring (`FANSTORE_FUSE_URING=1`, `_shim_uring.c`) on real mounts: the dataset
read byte for byte by concurrent readers while a writer creates, renames and removes files;
every request processed exactly once (libfuse's debug log) and taken from the rings; one ring
thread per CPU, pinned, SCHED_IDLE (SCHED_OTHER while kicked or while requests overlap);
remote blobs of a 2-rank mount; the daemon ending on an external unmount. Needs Linux 6.14+ (the fuse module's
`enable_uring`); the daemon turns that on as root."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from pathlib import Path

import pytest
from _harness import fuse_mounts, mounted, prep_cli, status_ranks
from test_fusethreads import (
    _read_and_write,
    _running,
    _thread_policies,
    _tree,
    _uniques,
    unmount_externally,
)

from fanstore_fuse._readahead import ENABLE_URING, enable_fuse_uring

pytestmark = [
    pytest.mark.mount,
    pytest.mark.skipif(not os.path.exists(ENABLE_URING),
                       reason="this kernel has no FUSE over io_uring (Linux < 6.14)"),
]
URING = {"FANSTORE_FUSE_URING": "1"}

# tests counting OPEN/RELEASE requests answer them (FANSTORE_NO_OPEN=0; default: none sent)
OPENED = {"FANSTORE_NO_OPEN": "0"}


def _shim(m, rank: int = 0) -> dict[str, int]:
    return status_ranks(m.status())[rank]["fuse_shim"]


@contextlib.contextmanager
def _mount(tmp_path: Path, state_dir, debug: bool = False, ranks: int | None = None,
           env: dict[str, str] | None = None):
    src = tmp_path / "src"
    files = _tree(src)
    dest = prep_cli(src, tmp_path / "dest", *(["-p", "4"] if ranks else []))
    mnt = tmp_path / ("mnt{rank}" if ranks else "mnt")
    with mounted(dest, mnt, state_dir, local=tmp_path / ("local{rank}" if ranks else "local"),
                 ranks=ranks, extra_args=["--debug"] if debug else [], env={**URING, **(env or {})}) as m:
        yield m, files


def _affinity(pid: int, prefix: str) -> list[set[int]]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/task/{tid}/comm").read_text().startswith(prefix):
                out.append(os.sched_getaffinity(int(tid)))
    return out


@pytest.mark.timeout(240)
def test_ring_threads_take_the_requests_while_files_are_written(tmp_path, state_dir):
    with _mount(tmp_path, state_dir, debug=True, env=OPENED) as (m, files):
        _read_and_write(m, files, 4, 3, 60)
        c = _shim(m)
        cpus = os.sysconf("SC_NPROCESSORS_CONF")
        assert c["c_uring_queues"] == cpus, c
        assert c["c_uring_depth"] == min(16, max(2, 256 // cpus)), c
        assert c["c_uring_errors"] == 0, c
        # the readers' opens and releases came by the rings, and were answered in C
        assert c["c_uring_requests"] >= 4 * 3 * len(files), c
        assert c["c_opens"] >= 4 * 3 * len(files), c
        assert c["c_thread_handed"] >= 60, c  # the writer's requests went to Python
        log = m.log_text()
        seen = _uniques(log)
        twice = [u for u, k in seen.items() if k > 1]
        assert twice == [], f"requests processed more than once: {twice[:10]}"
        assert len(seen) >= c["c_uring_requests"], (len(seen), c)
        assert "Traceback" not in log
        st = m.state()
        assert st is not None and st.pids
        pid = st.pids[0]
        # readers' requests came while the writer's were held by Python: overlap, SCHED_OTHER
        assert c["c_uring_contended"] >= 1, c
        # SCHED_IDLE (5) again: a ring thread kicked by another thread's reply runs SCHED_OTHER
        # until it waits again, one that saw requests overlap until 20 ms pass without overlap
        deadline = time.monotonic() + 5
        while sorted(_thread_policies(pid, "fanstore-ring")) != [5] * cpus:
            assert time.monotonic() < deadline, _thread_policies(pid, "fanstore-ring")
            time.sleep(0.05)
        assert sorted(map(sorted, _affinity(pid, "fanstore-ring"))) == [[k] for k in range(cpus)]
        m.umount()
    assert m.forced == []
    for pid in st.pids:
        assert not _running(pid), f"daemon {pid} still running"


@pytest.mark.timeout(240)
def test_two_entries_per_queue_serve_concurrent_readers_and_a_writer(tmp_path, state_dir):
    """FANSTORE_FUSE_URING_DEPTH=2 (what a node with 128 CPUs gets): four readers and a
    writer hold more requests than a queue has entries; the rest wait in the kernel and every
    file still reads byte for byte."""
    with _mount(tmp_path, state_dir, env={"FANSTORE_FUSE_URING_DEPTH": "2", **OPENED}) as (m,
                                                                                  files):
        _read_and_write(m, files, 4, 2, 30)
        c = _shim(m)
        assert c["c_uring_depth"] == 2 and c["c_uring_errors"] == 0, c
        assert c["c_uring_requests"] >= 4 * 2 * len(files), c
        m.umount()
    assert m.forced == []


@pytest.mark.timeout(240)
@pytest.mark.parametrize("direct", ["", "0"])
def test_two_ranks_read_remote_blobs_through_the_rings(tmp_path, state_dir, direct):
    """Every file byte for byte through rank 0's rings. A ring thread sends a small remote
    READ's request itself with its own reply bell, polled in its ring, and answers the READ when
    that bell rings (`thread_replies`); `FANSTORE_FUSE_URING_DIRECT=0`: the remote thread sends
    and answers them all."""
    knob = {"FANSTORE_FUSE_URING_DIRECT": direct} if direct else {}
    with _mount(tmp_path, state_dir, ranks=2, env=knob) as (m, files):
        root = Path(m.mountpoints[0])
        for rel, body in sorted(files.items()):
            with open(root / rel, "rb", buffering=0) as f:
                assert f.read() == body, rel
        ranks = status_ranks(m.status())
        assert ranks[0]["stats"]["remote_reads"] > 0, ranks[0]["stats"]
        c = ranks[0]["c_remote"]
        assert c["c_reads"] > 0 and c["corrupt"] == c["timeouts"] == c["c_read_fallbacks"] == 0, c
        if direct == "0":
            assert c["thread_replies"] == c["direct_sends"] == 0, c
        else:  # nearly every reply: one may reach the remote thread first (woken meanwhile)
            assert c["direct_sends"] > 0 and c["thread_replies"] >= c["c_reads"] // 2, c
        for r in ranks:
            assert r["fuse_shim"]["c_uring_errors"] == 0, r["fuse_shim"]
        assert ranks[0]["fuse_shim"]["c_uring_requests"] >= len(files), ranks[0]["fuse_shim"]
        assert "Traceback" not in m.log_text()
        m.umount()
    assert m.forced == []


@pytest.mark.timeout(120)
def test_external_unmount_ends_the_daemon_with_rings(tmp_path, state_dir):
    with _mount(tmp_path, state_dir) as (m, files):
        rel = sorted(files)[5]
        assert (m.path / rel).read_bytes() == files[rel]
        assert _shim(m)["c_uring_queues"] > 0
        unmount_externally(m)


@pytest.mark.timeout(120)
def test_a_killed_daemon_with_rings_leaves_a_stale_mount_that_umount_cleans(tmp_path, state_dir):
    """SIGKILL with the rings up: the mount answers an error at once (the kernel's ring
    teardown may give ECANCELED to a request it caught), `umount` cleans it, and a fresh mount
    at the same place reads again."""
    with _mount(tmp_path, state_dir) as (m, files):
        rel = sorted(files)[3]
        assert (m.path / rel).read_bytes() == files[rel]
        assert _shim(m)["c_uring_queues"] > 0
        pids = m.pids()
        for p in pids:
            os.kill(p, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(_running(p) for p in pids):
            assert time.monotonic() < deadline, "the daemon did not die"
            time.sleep(0.05)
        for k in range(3):  # names never looked up (the kernel caches the others' entries)
            with pytest.raises(OSError) as ei:
                os.stat(m.path / f"never-looked-up-{k}")
            assert ei.value.errno in (errno.ENOTCONN, errno.ECONNABORTED, errno.ECANCELED)
        r = m.umount()
        assert "cleaned stale mount" in r.stderr, r.stderr
        assert str(m.path) not in fuse_mounts()
    assert m.forced == []
    with mounted(tmp_path / "dest", tmp_path / "mnt", state_dir, local=tmp_path / "local",
                 env=URING) as m2:
        assert (m2.path / rel).read_bytes() == files[rel]
        assert _shim(m2)["c_uring_queues"] > 0
    assert m2.forced == []


def test_enable_fuse_uring_writes_the_module_parameter(tmp_path):
    p = tmp_path / "enable_uring"
    p.write_text("N\n")
    assert enable_fuse_uring(str(p)) is True
    assert p.read_text() == "1"
    p.write_text("Y\n")
    assert enable_fuse_uring(str(p)) is True  # already on: left as it is
    assert p.read_text() == "Y\n"
    assert enable_fuse_uring(str(tmp_path / "missing" / "enable_uring")) is False
