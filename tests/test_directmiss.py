"""Cold small blobs read around the page cache (`_shim_blobs.c`, FANSTORE_DIRECT_MISS): real
mounts whose staged copies were evicted for sure (`drop_page_cache`, checked with `mincore`).
A whole small blob not in the page cache is refused to the nowait read without any I/O
(`c_direct_gated`) and read with O_DIRECT (`c_direct_reads`): the bytes come back identical to
the source and the copy's pages stay out of the page cache (so the stream can later fill it
with large folios). A flipped bit or a copy cut short still gives EIO, never bad bytes, and
the daemon keeps serving. FANSTORE_DIRECT_MISS=0 reads through the page cache as before."""

from __future__ import annotations

import errno
import os
import random
import time
from pathlib import Path

import pytest
from _harness import mounted, prep_cli, status_ranks
from _pagecache import drop_page_cache, files_pages, staged_copies

from fanstore_fuse import _fastclose

pytestmark = [
    pytest.mark.mount,
    pytest.mark.skipif(_fastclose._shim is None or not hasattr(_fastclose._shim, "direct_counts"),
                       reason="the C shim is not built (no compiler or headers)"),
]

# fewer cold reads than the 16 that start a stream (_shim_stream.c): nothing but the reads
# themselves touches the copy
FILES = 12


def _tree(src: Path, seed: int) -> dict[str, bytes]:
    rng = random.Random(seed)
    files = {f"d{i % 3}/f{i:02d}.bin": rng.randbytes(rng.randint(40_000, 90_000))
             for i in range(FILES)}
    for rel, body in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(body)
    return files


def _evict(parts: list[Path]) -> None:
    drop_page_cache(parts)
    assert files_pages(parts)[0] == 0
    os.system("echo 1 > /proc/sys/vm/drop_caches")  # the mount's own cached pages too


def _shim(m) -> dict[str, int]:
    return status_ranks(m.status())[0]["fuse_shim"]


def _read(path: Path) -> bytes | int:
    """The file's bytes, or the errno its read failed with."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        return e.errno


@pytest.mark.timeout(120)
@pytest.mark.parametrize("knob", ["", "0"])
def test_cold_small_files_are_read_around_the_page_cache(tmp_path, state_dir, knob):
    files = _tree(tmp_path / "src", seed=11)
    dest = prep_cli(tmp_path / "src", tmp_path / "dest")
    local = tmp_path / "local"
    env = {"FANSTORE_DIRECT_MISS": knob} if knob else {}
    with mounted(dest, tmp_path / "mnt", state_dir, local=local, env=env) as m:
        parts = staged_copies(local)
        _evict(parts)
        before = _shim(m)
        for rel, body in files.items():
            assert _read(m.path / rel) == body, rel
        c = _shim(m)
        direct = c["c_direct_reads"] - before["c_direct_reads"]
        gated = c["c_direct_gated"] - before["c_direct_gated"]
        assert c["c_read_fallbacks"] == 0 and c["stream_runs"] == 0, c
        if knob == "0":  # off: buffered reads, which leave the blobs in the page cache
            assert direct == 0 and gated == 0, c
            assert files_pages(parts)[0] > 0
        else:
            assert direct == FILES and gated == FILES, c
            assert c["c_direct_bytes"] - before["c_direct_bytes"] >= sum(map(len, files.values()))
            assert files_pages(parts)[0] == 0  # not one page of the copy read into the page cache
            # read again from the mount's page cache; evicted, the copy is read directly again
            for rel, body in files.items():
                assert _read(m.path / rel) == body, rel
            _evict(parts)
            for rel, body in sorted(files.items(), reverse=True):
                assert _read(m.path / rel) == body, rel
            c2 = _shim(m)
            again = c2["c_direct_reads"] - c["c_direct_reads"]
            # 16 cold reads since the mount (12 + 4) start the stream: the rest may be hits
            assert again == FILES or (again >= 16 - FILES and c2["stream_runs"] == 1), c2


def _flip_one_byte_per_part(parts: list[Path]) -> None:
    """A bit flipped in the middle of each copy (inside some blob's bytes: the header and any
    padding are far smaller than the data), made durable so that eviction leaves only the disk."""
    for p in parts:
        size = p.stat().st_size
        with open(p, "r+b") as f:
            f.seek(size // 2)
            b = f.read(1)
            f.seek(size // 2)
            f.write(bytes([b[0] ^ 0x10]))
            f.flush()
            os.fsync(f.fileno())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("damage", ["flipped bit", "cut short"])
def test_a_damaged_copy_read_directly_gives_eio_never_bad_bytes(tmp_path, state_dir, damage):
    files = _tree(tmp_path / "src", seed=12)
    dest = prep_cli(tmp_path / "src", tmp_path / "dest")
    local = tmp_path / "local"
    with mounted(dest, tmp_path / "mnt", state_dir, local=local) as m:
        parts = staged_copies(local)
        if damage == "flipped bit":
            _flip_one_byte_per_part(parts)
        else:
            for p in parts:
                os.truncate(p, p.stat().st_size // 2)
        _evict(parts)
        before = _shim(m)
        got = {rel: _read(m.path / rel) for rel in files}
        bad = [rel for rel, g in got.items() if g != files[rel]]
        assert bad, "no file was hit"
        assert all(got[rel] == errno.EIO for rel in bad), {r: got[r] for r in bad if isinstance(got[r], int)}
        if damage == "cut short":  # the files wholly in the first half read back intact
            assert len(bad) < len(files)
        c = _shim(m)
        assert c["c_direct_reads"] > before["c_direct_reads"], c
        # the daemon keeps serving: the intact files again, from a cold copy
        _evict(parts)
        for rel in files:
            if rel not in bad:
                assert _read(m.path / rel) == files[rel], rel


@pytest.mark.timeout(180)
@pytest.mark.mpi
@pytest.mark.parametrize("knob", ["", "0"])
def test_cold_disk_cache_entries_are_read_around_the_page_cache(tmp_path, state_dir, knob):
    """Epoch 2 of a 2-rank mount, the stream off: rank 0 reads the blobs rank 1 holds from its
    disk cache of remote blobs (`_shim_cache.c`). With the cache's segments evicted, a cold
    entry is refused to the nowait read without any I/O (`c_cache_gated`) and read with O_DIRECT
    (`c_cache_direct`): every file byte for byte, and not one page of the segments in the page
    cache after. FANSTORE_CACHE_DIRECT=0: buffered reads, which leave the segments' pages."""
    files = _tree(tmp_path / "src", seed=13)
    dest = prep_cli(tmp_path / "src", tmp_path / "dest", "-p", "4")
    local = tmp_path / "local"
    env = {"FANSTORE_CACHE_BYTES": str(1 << 20), "FANSTORE_STREAM_IN": "0"}
    if knob:
        env["FANSTORE_CACHE_DIRECT"] = knob
    with mounted(dest, str(tmp_path / "mnt" / "{rank}"), state_dir, ranks=2,
                 local=str(local / "{rank}"), env=env) as m:
        root = Path(m.mountpoints[0])
        for rel, body in files.items():  # epoch 1: rank 1's blobs fetched, cached on rank 0
            assert _read(root / rel) == body, rel
        deadline = time.monotonic() + 30
        while (dc := status_ranks(m.status())[0]["disk_cache"])["entries"] < dc["misses"] or \
                not dc["entries"]:
            assert time.monotonic() < deadline, dc
            time.sleep(0.05)
        segments = sorted((local / "0" / "cache").glob("seg-*.fsc"))
        assert segments, list((local / "0").rglob("*"))
        os.sync()  # written entries are dirty pages, which eviction cannot drop
        _evict(staged_copies(local / "0") + segments)
        before = _shim(m)
        for rel, body in sorted(files.items(), reverse=True):
            assert _read(root / rel) == body, rel
        c = _shim(m)
        hits = c["c_cache_hits"] - before["c_cache_hits"]
        direct = c["c_cache_direct"] - before["c_cache_direct"]
        gated = c["c_cache_gated"] - before["c_cache_gated"]
        assert hits == dc["entries"] and c["c_cache_fallbacks"] == before["c_cache_fallbacks"], c
        if knob == "0":
            assert direct == 0 and gated == 0, c
            assert files_pages(segments)[0] > 0
        else:
            assert direct == hits and gated == hits, c
            assert files_pages(segments)[0] == 0  # not one page of the segments read in
