"""Large files through a real mount: the kernel read-ahead the daemon sets (1 MiB requests
instead of 128 KiB ones) survives the FUSE INIT reply, and sequential reads of raw and
compressible chunks come back byte for byte."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
from _harness import mounted, prep_cli

from fanstore_fuse._readahead import bdi_path

MiB = 1 << 20


def _tensor(n: int) -> bytes:
    import numpy as np

    x = np.arange(n // 4, dtype=np.float32)
    noise = np.random.default_rng(5).integers(-3, 4, x.size)
    return (np.round(127.5 + 100 * np.sin(x * 0.001)) + noise).astype(np.float32).tobytes()


@pytest.mark.mount
@pytest.mark.timeout(120)
def test_readahead_held_after_init_and_sequential_bytes(tmp_path: Path, state_dir: Path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "rand.bin").write_bytes(random.Random(1).randbytes(9 * MiB + 4321))
    (src / "tensor.f32").write_bytes(_tensor(9 * MiB + 4096))
    dest = prep_cli(src, tmp_path / "dest", "-p", "2")
    with mounted(dest, tmp_path / "mp", state_dir, local=tmp_path / "local") as mt:
        path = bdi_path(str(mt.path))
        assert path is not None
        deadline = time.monotonic() + 10
        while True:  # the daemon sets it again once INIT is answered (a few ms after mount)
            kb = int(Path(path).read_text())
            if kb == 1024 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert kb == 1024, "read-ahead cut back to the INIT default"
        for name in ("rand.bin", "tensor.f32"):
            want = (src / name).read_bytes()
            with open(mt.path / name, "rb", buffering=0) as f:
                got = b"".join(iter(lambda: f.read(MiB), b""))
            assert got == want, name
            fd = os.open(mt.path / name, os.O_RDONLY)
            try:
                rng = random.Random(len(want))
                for _ in range(200):
                    off, n = rng.randrange(len(want) + 10), rng.choice([1, 4096, 70_000, MiB + 3])
                    assert os.pread(fd, n, off) == want[off : off + n], (name, off, n)
            finally:
                os.close(fd)
        mt.umount()
        assert "set to 1024 KiB after INIT" in mt.log_text()


@pytest.mark.mount
@pytest.mark.timeout(120)
def test_concurrent_direct_random_reads(tmp_path: Path, state_dir: Path):
    """Many 4 KiB O_DIRECT reads in flight at once (as `fio --iodepth=16`): with requests
    queued in /dev/fuse the daemon sends small cold reads to worker threads instead of reading
    inline (`_fusequeue`); every byte still matches, raw sub-blocks and zstd frames alike."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    src = tmp_path / "src"
    src.mkdir()
    files = {"rand.bin": random.Random(2).randbytes(6 * MiB + 999),
             "tensor.f32": _tensor(6 * MiB)}  # fmt: skip
    for name, data in files.items():
        (src / name).write_bytes(data)
    dest = prep_cli(src, tmp_path / "dest", "-p", "2")
    with mounted(dest, tmp_path / "mp", state_dir, local=tmp_path / "local") as mt:

        def worker(seed: int) -> int:
            rng = random.Random(seed)
            buf = mmap.mmap(-1, 8192)
            checked = 0
            for name, want in files.items():
                fd = os.open(mt.path / name, os.O_RDONLY | os.O_DIRECT)
                try:
                    for _ in range(150):
                        off = rng.randrange(0, len(want) - 4096) & ~4095
                        n = rng.choice([4096, 8192])
                        got = os.preadv(fd, [memoryview(buf)[:n]], off)
                        assert buf[:got] == want[off : off + got], (name, off, n)
                        checked += got
                finally:
                    os.close(fd)
            return checked

        with ThreadPoolExecutor(16) as ex:
            total = sum(ex.map(worker, range(16)))
        assert total >= 16 * 2 * 150 * 4096
        for name, want in files.items():
            assert (mt.path / name).read_bytes() == want
        mt.umount()


@pytest.mark.parametrize("cut_first", [True, False])
def test_hold_readahead_either_order(tmp_path: Path, cut_first: bool):
    """The kernel's cut (INIT answered) may come before or after the daemon's task first looks:
    either way the value ends at the daemon's, written once. A plain file stands in for sysfs."""
    import trio

    from fanstore_fuse._readahead import hold_readahead

    f = tmp_path / "read_ahead_kb"
    f.write_text("128\n" if cut_first else "1024\n")

    async def main() -> None:
        with trio.fail_after(10):
            await run()

    async def run() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(hold_readahead, "/nowhere", 1024, 5.0, str(f))
            if not cut_first:
                await trio.sleep(0.05)
                f.write_text("128\n")  # the kernel reads the INIT reply

    trio.run(main)
    assert f.read_text().strip() == "1024"
