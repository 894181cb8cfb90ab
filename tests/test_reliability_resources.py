"""Faults, 2. resources and dead mounts: a full local dir, a disk that fills during stage-in,
bad mountpoints, a SIGKILLed daemon's dead mount cleared by `umount`.

Each test states the expected outcome in its docstring and asserts it; docs/reliability.md
describes them.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from _harness import cli_env, fuse_mounts, mounted, run_cli, small_tmpfs
from _reliability_helpers import WIDE, small_dataset

from fanstore_fuse import PrepOptions, prep
from fanstore_fuse._errors import FanstoreError
from fanstore_fuse._format import MANIFEST_NAME
from fanstore_fuse._manifest import read_manifest
from fanstore_fuse._mountctl import prepare_local_dir, remove_local_dir

pytestmark = pytest.mark.fault


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    return small_dataset(tmp_path_factory.mktemp("small"))


@pytest.fixture(scope="module")
def big_dest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~3 MiB of incompressible data in 2 partitions: more than a 2 MiB tmpfs holds."""
    base = tmp_path_factory.mktemp("big")
    for i in range(6):
        (base / "src").mkdir(exist_ok=True)
        (base / "src" / f"r{i}.bin").write_bytes(os.urandom(512 * 1024))
    prep(base / "src", base / "dest", PrepOptions(partitions=2, codec="none", workers=1))
    return base / "dest"


@pytest.mark.mount
@pytest.mark.timeout(60)
def test_full_local_dir_fails_cleanly(big_dest: Path, tmp_path: Path, state_dir: Path):
    """Local dir on a 2 MiB tmpfs, dataset 3 MiB: mount exits non-zero with one line saying how
    much space there is and is needed; nothing mounted, no daemon, the local copy removed."""
    with small_tmpfs(tmp_path / "small-fs") as fs:
        mp = tmp_path / "mp"
        mp.mkdir()
        local = fs / "local"
        r = run_cli("mount", big_dest, mp, "--local", local, env=cli_env(state_dir, **WIDE),
                    check=False, timeout=60)
        assert r.returncode != 0
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "free" in lines[0] and "needs" in lines[0], r.stderr
        assert str(mp) not in fuse_mounts() and not os.listdir(mp)
        assert not local.exists(), os.listdir(local)
        assert not list(state_dir.glob("*.json"))
        assert shutil.disk_usage(fs).used < 64 * 1024


def test_disk_filling_during_stage_in_is_a_clear_error(big_dest: Path, tmp_path: Path, monkeypatch):
    """The free-space check passes (another job could still fill the disk afterwards), then the
    copy hits ENOSPC: stage_in raises 'is full (ENOSPC)' and the local dir can be removed whole."""
    from fanstore_fuse import _stage

    real = os.statvfs

    class Roomy:
        def __init__(self, st):
            self.f_frsize, self.f_bavail = st.f_frsize, 1 << 40

    monkeypatch.setattr(_stage.os, "statvfs", lambda p: Roomy(real(p)))
    m = read_manifest(big_dest / MANIFEST_NAME)
    with small_tmpfs(tmp_path / "small-fs") as fs:
        local = prepare_local_dir(str(fs / "local"))
        with pytest.raises(FanstoreError, match="full|ENOSPC|space") as ei:
            _stage.stage_in(str(big_dest), local, m)
        monkeypatch.undo()
        assert str(fs) in str(ei.value)
        remove_local_dir(local)
        assert not os.path.exists(local)
        assert shutil.disk_usage(fs).used < 64 * 1024


@pytest.mark.mount
@pytest.mark.timeout(60)
def test_bad_mountpoints_give_clear_errors(small, tmp_path: Path, state_dir: Path):
    """Missing, a file, not empty, read-only (bind mount), already mounted: one line each,
    exit != 0, nothing (new) mounted."""
    dest, files = small
    env = cli_env(state_dir, **WIDE)

    def fails(mp: Path, want: str) -> None:
        before = fuse_mounts().get(str(mp))
        r = run_cli("mount", dest, mp, env=env, check=False, timeout=60)
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and len(lines) == 1 and want in lines[0], r.stderr
        assert fuse_mounts().get(str(mp)) == before

    fails(tmp_path / "missing", "does not exist")
    (tmp_path / "file").write_text("x")
    fails(tmp_path / "file", "not a directory")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    fails(tmp_path / "full", "not empty")
    ro = tmp_path / "ro"
    (ro / "mp").mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(ro), str(ro)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], check=True)
        fails(ro / "mp", "not writable")
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=True)
    with mounted(dest, tmp_path / "mp", state_dir) as m:
        fails(m.path, "already a mount")
        assert (m.path / "big.bin").read_bytes() == files["big.bin"]  # the first mount still serves
    assert str(tmp_path / "mp") not in fuse_mounts()


@pytest.mark.mount
@pytest.mark.timeout(90)
def test_sigkilled_daemon_leaves_a_dead_mount_that_umount_clears(small, tmp_path: Path,
                                                                  state_dir: Path):
    """SIGKILL the single-node daemon while a reader loops: the reader gets an errno (ENOTCONN)
    within 5 s, `umount` clears the dead mount and the local copy, a new mount serves exact bytes."""
    dest, files = small
    mp, local = tmp_path / "mp", tmp_path / "local"
    errors: list[int] = []
    with mounted(dest, mp, state_dir, local=local) as m:
        stop = threading.Event()

        def reader() -> None:
            names = sorted(files)
            k = 0
            while not stop.is_set():
                try:
                    (m.path / names[k % len(names)]).read_bytes()
                    # files open without OPEN: cached files stay readable from the page cache
                    # once the daemon is gone; a listing (OPENDIR) always asks it
                    os.listdir(m.path)
                except OSError as e:
                    errors.append(e.errno)
                    return
                k += 1

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        for p in m.pids():
            os.kill(p, signal.SIGKILL)
        t.join(5)
        waited = time.monotonic() - t0
        stop.set()
        assert not t.is_alive(), "reader hung on a dead mount"
        assert errors and errors[0] in (errno.ENOTCONN, errno.ECONNABORTED), errors
        assert waited < 5
        r = m.umount()
        assert r.returncode == 0 and str(mp) not in fuse_mounts()
        assert not local.exists()
    with mounted(dest, mp, state_dir, local=local) as m2:
        for rel, want in files.items():
            assert (m2.path / rel).read_bytes() == want
    assert m2.forced == [] and str(mp) not in fuse_mounts()


def _shm_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("mpich_shm_")}


@pytest.mark.mount
@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_sigkilled_ranks_leave_no_shared_memory_behind(small, tmp_path: Path, state_dir: Path):
    """MPICH removes its /dev/shm segment in MPI_Finalize only; the daemons remove its name once
    every rank of the host has attached it. Two ranks read byte for byte, their mappings of the
    segment show "(deleted)" while they serve, and after both are SIGKILLed no new segment name
    is left in /dev/shm (RAM) (before: one of 17 MB per killed job, 3.2 GB on this machine)."""
    dest, files = small
    before = _shm_segments()
    with mounted(dest, tmp_path / "mp" / "{rank}", state_dir, local=tmp_path / "local" / "{rank}",
                 ranks=2) as m:
        for rel, want in files.items():
            assert (Path(m.mountpoints[0]) / rel).read_bytes() == want
        st = m.state()
        assert st is not None and len(st.pids) == 2
        pids = list(st.pids)
        mapped = []
        for p in pids:
            with open(f"/proc/{p}/maps") as f:
                mapped += [ln.split(None, 5)[5].strip() for ln in f if "/dev/shm/mpich_shm_" in ln]
        assert mapped and all(path.endswith("(deleted)") for path in mapped), mapped
        for p in pids:
            os.kill(p, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        m.umount()
    assert _shm_segments() - before == set()
