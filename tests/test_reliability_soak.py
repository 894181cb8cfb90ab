"""Faults, 4. a concurrency soak: threads and processes read random files through 3 ranks for a
bounded time (FANSTORE_SOAK_SECONDS, default 15), every byte compared.

Each test states the expected outcome in its docstring and asserts it (docs/reliability.md,
section 5).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import threading
import time
from pathlib import Path

import pytest
from _harness import prep_cli
from _reliability_helpers import content

pytestmark = pytest.mark.fault


SOAK_FILES = 3000
SOAK_SECONDS = float(os.environ.get("FANSTORE_SOAK_SECONDS", "15"))


def _soak_size(i: int) -> int:
    return (i * 7919) % 6000 + (i % 3)


def _soak_worker(mps: list[str], deadline: float, seed: int) -> tuple[int, int, int, list[str]]:
    """Read random files from random ranks until the deadline; (files, bytes, errors, samples)."""
    rng = random.Random(seed)
    n = nbytes = 0
    errs: list[str] = []
    while time.time() < deadline:
        i = rng.randrange(SOAK_FILES)
        p = os.path.join(rng.choice(mps), f"s{i % 30:02d}", f"f{i:05d}.bin")
        try:
            with open(p, "rb") as f:
                data = f.read()
        except OSError as e:
            errs.append(f"{p}: {e}")
            continue
        if data != content(i, _soak_size(i)):
            errs.append(f"{p}: wrong bytes")
            continue
        n += 1
        nbytes += len(data)
    return n, nbytes, len(errs), errs[:5]


def _soak_proc(args) -> tuple[int, int, int, list[str]]:
    return _soak_worker(*args)


@pytest.mark.mount
@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_concurrency_soak_three_ranks(tmp_path: Path, mount_factory):
    """8 threads + 8 processes read random files of 3,000 through 3 ranks' mounts for a bounded
    time: zero errors, every byte compared with what was written."""
    src = tmp_path / "src"
    for i in range(SOAK_FILES):
        p = src / f"s{i % 30:02d}" / f"f{i:05d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content(i, _soak_size(i)))
    dest = prep_cli(src, tmp_path / "dest", "-p", "3")
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=3,
                      local=str(tmp_path / "local" / "{rank}"), extra_args=["--replicas", "2"])
    deadline = time.time() + SOAK_SECONDS
    results: list[tuple[int, int, int, list[str]]] = []
    lock = threading.Lock()

    def thread_main(seed: int) -> None:
        r = _soak_worker(m.mountpoints, deadline, seed)
        with lock:
            results.append(r)

    t0 = time.monotonic()
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(8) as pool:
        async_res = pool.map_async(_soak_proc, [(m.mountpoints, deadline, 100 + k) for k in range(8)])
        threads = [threading.Thread(target=thread_main, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(SOAK_SECONDS + 60)
        results += async_res.get(SOAK_SECONDS + 60)
    elapsed = time.monotonic() - t0
    files = sum(r[0] for r in results)
    nbytes = sum(r[1] for r in results)
    nerr = sum(r[2] for r in results)
    samples = [s for r in results for s in r[3]]
    print(f"soak: 16 readers, {elapsed:.1f} s, {files} files, {nbytes} bytes verified, "
          f"{nerr} errors, {files / elapsed:.0f} files/s")
    assert len(results) == 16
    if nerr:
        print("daemon log tail:\n" + m.log_text()[-6000:])
    assert nerr == 0, samples
    assert files > 1000 and all(r[0] > 0 for r in results)
    m.umount()
    assert not list((tmp_path / "local").glob("*/*"))
