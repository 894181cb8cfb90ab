"""A partition a cold read misses is read into the page cache whole while the node's partitions
fit in half the available memory (`_warmup.PartitionWarmup`), and not when they do not: checked
with `mincore` on a real file, then on a real mount whose staged copies were evicted."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
from _harness import mounted, prep_cli, status_ranks
from _pagecache import drop_page_cache, files_pages, staged_copies

from fanstore_fuse._warmup import PartitionWarmup, mem_available


def _wait(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def _cold_file(path: Path, size: int) -> int:
    path.write_bytes(random.Random(1).randbytes(size))
    drop_page_cache([path])
    return os.open(path, os.O_RDONLY)


@pytest.mark.timeout(60)
def test_a_missed_partition_is_read_whole_when_it_fits(tmp_path):
    fd = _cold_file(tmp_path / "part-00000.fsp", 3 << 20)
    try:
        w = PartitionWarmup(str(tmp_path), ["part-00000.fsp"], available=lambda: 1 << 40)
        w.miss(0, fd)
        w.miss(0, fd)  # queued already: not asked twice
        assert _wait(lambda: w.done == 1)
        assert files_pages([tmp_path / "part-00000.fsp"]) == (768, 768)
        w.miss(0, fd)  # a miss just after a read-ahead: not asked again
        time.sleep(0.2)
        assert w.done == 1
    finally:
        os.close(fd)


@pytest.mark.timeout(60)
def test_nothing_is_read_ahead_when_the_partitions_do_not_fit(tmp_path):
    fd = _cold_file(tmp_path / "part-00000.fsp", 3 << 20)
    try:
        w = PartitionWarmup(str(tmp_path), ["part-00000.fsp", "absent.fsp"],
                            available=lambda: 5 << 20)  # half of it is less than 3 MiB
        w.miss(0, fd)
        time.sleep(0.5)
        assert w.done == 0
        assert files_pages([tmp_path / "part-00000.fsp"])[0] == 0
    finally:
        os.close(fd)
    assert mem_available() > 0  # this kernel reports it: the daemons' rule is live here


@pytest.mark.mount
@pytest.mark.timeout(180)
def test_a_cold_mount_reads_its_partitions_ahead(tmp_path, state_dir):
    rng = random.Random(5)
    src = tmp_path / "src"
    files = {f"d{i % 4}/f{i:03d}.bin": rng.randbytes(rng.randint(20_000, 90_000))
             for i in range(200)}
    for rel, body in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(body)
    dest = prep_cli(src, tmp_path / "dest", "--partitions", "3")
    local = tmp_path / "local"
    with mounted(dest, tmp_path / "mnt", state_dir, local=local) as m:
        parts = staged_copies(local)
        drop_page_cache(parts)
        os.system("echo 1 > /proc/sys/vm/drop_caches")  # the mount's own pages (root only)
        names = sorted(files)
        random.Random(2).shuffle(names)
        for rel in names[:10]:
            assert (m.path / rel).read_bytes() == files[rel], rel
        resident, total = files_pages(parts)
        assert _wait(lambda: files_pages(parts)[0] == total), (resident, total)
        for rel in names:
            assert (m.path / rel).read_bytes() == files[rel], rel
        s = status_ranks(m.status())[0]["stats"]
        assert 1 <= s["partition_readaheads"] <= len(parts), s
        assert s["errors"] == 0 and s["reads"] >= len(files), s


def test_a_daemon_thread_carries_its_name_in_the_os():
    """`name_this_thread`: `top -H`, py-spy and bench.cost see the thread's own name."""
    import threading

    from fanstore_fuse._fsio import name_this_thread

    seen: list[str] = []

    def run() -> None:
        name_this_thread()
        with open("/proc/thread-self/comm") as f:
            seen.append(f.read().strip())

    t = threading.Thread(target=run, name="fanstore-warmup-and-more")
    t.start()
    t.join()
    assert seen == ["fanstore-warmup"]  # the OS keeps 15 bytes
