"""bench/nullfs.py, the floor bench.smallfile compares fanstore-fuse with: it mounts, serves the
tree shape it was given with the bytes of its own pattern, counts its requests, and goes away on
a lazy unmount. (The bench itself is never run here: figures are not unit tests.)"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # the repository, for bench/

from bench import nullfs  # noqa: E402

pytestmark = [pytest.mark.mount, pytest.mark.timeout(180)]


def _tree(src: Path) -> None:
    rng = random.Random(7)
    sizes = [0, 1, 4095, 4096, 131072, 131073, 3 * (1 << 20) + 17] + [
        rng.randint(90_000, 130_000) for _ in range(25)]
    for i, n in enumerate(sizes):
        p = src / f"d{i % 3}" / ("sub" if i % 5 == 0 else "") / f"f{i:03d}.jpg"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(rng.randbytes(n))
    (src / "empty-dir").mkdir()  # no file in it: not part of the shape (files only)


def _mounted(mp: Path) -> bool:
    with open("/proc/mounts") as f:
        return any(line.split()[1] == str(mp) for line in f)


def _wait_mounted(mp: Path, proc: subprocess.Popen, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, f"nullfs exited with {proc.returncode}: {proc.stderr.read()}"
        if _mounted(mp):
            os.listdir(mp)
            return
        time.sleep(0.05)
    pytest.fail(f"{mp} not mounted after {timeout} s")


def test_nullfs_mounts_serves_its_pattern_and_tears_down(tmp_path: Path) -> None:
    src, mp, stats = tmp_path / "src", tmp_path / "mnt", tmp_path / "stats.json"
    _tree(src)
    mp.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.nullfs", "--like", str(src), str(mp),
         "--stats-file", str(stats), "--max-seconds", "150"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_mounted(mp, proc, 60)
        shape = nullfs.walk(src)
        assert nullfs.walk(mp) == shape  # the same names, directories and sizes
        for i, (rel, size) in enumerate(shape):
            with open(mp / rel, "rb", buffering=0) as f:
                data = b"".join(iter(lambda f=f: f.read(1 << 20), b""))
            assert data == nullfs.expected(i, size), rel  # byte for byte
            with open(mp / rel, "rb") as f:  # a read in the middle of the file
                f.seek(size // 2)
                assert f.read(5000) == nullfs.expected(i, size, 0)[size // 2:size // 2 + 5000]
        assert nullfs.expected(1, 100) != nullfs.expected(2, 100)  # files differ
        with pytest.raises(FileNotFoundError):
            os.stat(mp / "d0" / "no-such-file")
        st = json.loads(os.getxattr(mp, "user.nullfs.status"))
        assert st["files"] == len(shape) and st["pid"] == proc.pid
        assert st["no_open"] == nullfs.PATCHED
        assert st["requests"]["lookup"] >= 1  # the missing name (the walk's READDIRPLUS
        assert st["requests"]["readdir"] >= 1  # gave the kernel every other entry)
        assert st["requests"]["read"] >= sum(1 for _, n in shape if n)
        assert st["cpu_s"] > 0
        assert "getxattr" not in st["requests"]  # the status read is not counted
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mp)], timeout=30, check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            proc.wait(timeout=20)  # the unmount ends its session: it exits by itself
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            pytest.fail("nullfs did not exit within 20 s of its unmount")
    assert proc.returncode == 0, proc.stderr.read()
    assert not _mounted(mp)
    final = json.loads(stats.read_text())
    assert final["requests"]["read"] >= st["requests"]["read"]
    assert json.loads(proc.stdout.read().strip().splitlines()[-1]) == final
