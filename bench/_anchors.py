"""The systems fanstore-fuse is measured against: native files, squashfuse, ratarmount, raw MPI.

Each system prepares its image (timed, from a cold page cache), mounts it (timed) and exposes
``root``: the directory where the dataset's source tree appears.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from ._datasets import Dataset
from ._util import Mount, dir_bytes, drop_caches, log, register, rm_rf, run_cmd, teardown, venv_tool
from ._util import wait_mounted as _wait_mounted


class System:
    """Base: a system that serves the dataset tree at ``root`` once mounted."""

    key = "system"
    label = "system"
    is_fuse = True
    remote_capable = False

    def __init__(self, ds: Dataset, work: Path, level: int, mount_timeout: float = 300):
        self.ds = ds
        self.work = work  # per-run scratch dir (unique path: also the daemon pid marker)
        self.level = level
        self.mount_timeout = mount_timeout
        self.root = ""
        self._mount: Mount | None = None
        self.available, self.why = self.check()
        self.info: dict = {}

    def check(self) -> tuple[bool, str]:
        return True, ""

    def prep(self) -> dict:
        return {}

    def mount(self) -> dict:
        raise NotImplementedError

    def umount(self) -> list[str]:
        if self._mount is None:
            return []
        m, self._mount = self._mount, None
        return teardown(m)

    def remote_files(self) -> list[tuple[str, int]] | None:
        return None


class Native(System):
    key = "native"
    label = "native ext4"
    is_fuse = False

    def check(self) -> tuple[bool, str]:
        fs = "?"
        try:
            st = os.stat(self.ds.src)
            with open("/proc/self/mountinfo") as f:
                for line in f:
                    parts = line.split()
                    if parts[2] == f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}":
                        fs = line.split(" - ")[1].split()[0]
        except (OSError, IndexError):
            pass
        self.label = f"native {fs}"
        return True, ""

    def mount(self) -> dict:
        self.root = str(self.ds.src)
        return {"mount_s": 0.0}


class SquashFuse(System):
    key = "squashfuse"
    label = "squashfuse"

    def check(self) -> tuple[bool, str]:
        self.exe = shutil.which("squashfuse")
        if not self.exe or not shutil.which("mksquashfs"):
            return False, "squashfuse/mksquashfs not installed (Debian squashfs-tools squashfuse)"
        return True, ""

    def prep(self) -> dict:
        self.image = self.work / "data.sqfs"
        rm_rf(self.image)
        drop_caches()
        cmd = [
            "mksquashfs", str(self.ds.src), str(self.image), "-comp", "zstd",
            "-Xcompression-level", str(self.level), "-noappend", "-no-progress",
            "-processors", str(os.cpu_count() or 1),
        ]  # fmt: skip
        dt, _ = run_cmd(cmd, timeout=1800)
        # fanstore-fuse's prep fsyncs its partitions before it writes the manifest; mksquashfs
        # returns with its image still in the page cache. Time both to the same point: durable.
        t_sync = _fsync_time(self.image)
        return {"prep_s": dt + t_sync, "prep_s_without_fsync": dt, "fsync_s": t_sync,
                "image_bytes": self.image.stat().st_size, "prep_cmd": " ".join(cmd) + " + fsync"}

    def mount(self) -> dict:
        mp = self.work / "mnt-squashfuse"
        return _mount_foreground(self, mp, [self.exe, "-f", str(self.image), str(mp)])


class Ratarmount(System):
    key = "ratarmount"
    label = "ratarmount"

    def check(self) -> tuple[bool, str]:
        self.exe = venv_tool("ratarmount")
        if not self.exe:
            return False, "ratarmount not installed (pip install ratarmount)"
        try:
            cp = subprocess.run(
                [self.exe, "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True, timeout=60,
            )  # fmt: skip
            m = re.search(r"ratarmount\s+(\S+)", cp.stdout)
            if m:
                self.label = f"ratarmount {m.group(1)}"
        except (OSError, subprocess.SubprocessError):
            pass
        return True, ""

    def prep(self) -> dict:
        self.tar = self.work / "data.tar"
        self.index = self.work / "data.tar.index.sqlite"
        rm_rf(self.tar)
        rm_rf(self.index)
        drop_caches()
        t_tar, _ = run_cmd(["tar", "-cf", str(self.tar), "-C", str(self.ds.src), "."], timeout=1800)
        t_idx, _ = run_cmd(
            [self.exe, "--no-mount", "--index-file", str(self.index), str(self.tar)], timeout=1800
        )
        t_sync = _fsync_time(self.tar) + _fsync_time(self.index)
        return {
            "prep_s": t_tar + t_idx + t_sync,
            "fsync_s": t_sync,
            "tar_s": t_tar,
            "index_s": t_idx,
            "image_bytes": self.tar.stat().st_size,
        }

    def mount(self) -> dict:
        mp = self.work / "mnt-ratarmount"
        return _mount_foreground(
            self, mp, [self.exe, "-f", "--index-file", str(self.index), str(self.tar), str(mp)]
        )


def cp_stage_in(src: Path, work: Path) -> dict:
    """The stage-in anchor: ``cp -r`` of a prepped image directory, from a cold page cache."""
    dst = work / "cp-stage-in"
    rm_rf(dst)
    drop_caches()
    dt, _ = run_cmd(["cp", "-r", str(src), str(dst)], timeout=1800)
    os.sync()
    nbytes = dir_bytes(dst)
    rm_rf(dst)
    return {"seconds": dt, "bytes": nbytes, "MB_per_s": nbytes / dt / 1e6}


def mpi_bandwidth(total_mb: int, timeout: float = 300) -> dict:
    """Raw mpi4py Send/Recv between two local ranks; see bench/_mpi_bw.py."""
    mpiexec = venv_tool("mpiexec")
    if not mpiexec:
        return {"error": "n/a (mpiexec not found in the venv)"}
    script = Path(__file__).with_name("_mpi_bw.py")
    py = venv_tool("python") or "python3"
    cmd = [mpiexec, "-n", "2", py, str(script), "--total-mb", str(total_mb)]
    try:
        _, cp = run_cmd(cmd, timeout=timeout)
    except Exception as e:  # noqa: BLE001
        return {"error": f"n/a ({e})"}
    for line in reversed(cp.stdout.splitlines()):
        if line.startswith("{"):
            d = json.loads(line)
            d["cmd"] = " ".join(cmd)
            return d
    log(f"mpi bandwidth: no JSON in output: {cp.stdout[-500:]}")
    return {"error": "n/a (no output)"}


def _fsync_time(path: Path) -> float:
    """Seconds to make a just-written file durable (what `prep` includes for fanstore-fuse)."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def _mount_foreground(system, mp: Path, argv: list[str]) -> dict:
    """Start a FUSE daemon that stays in the foreground, wait until `mp` is mounted, time it."""
    mp.mkdir(exist_ok=True)
    drop_caches()
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    system._mount = register(Mount(str(mp), procs=[p]))
    _wait_mounted(mp, system.mount_timeout, proc=p)
    system.root = str(mp)
    return {"mount_s": time.perf_counter() - t0}
