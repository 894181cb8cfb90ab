"""READs of dataset files on real mounts (1 and 3 ranks): a raw, a zstd (framed) and a
`--dict auto` tree read buffered and with O_DIRECT across frame and chunk edges, compared byte
for byte with the source, with concurrent readers; a corrupt local partition gives EIO and one
log line naming the file, never bytes."""

from __future__ import annotations

import errno
import mmap
import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from _harness import mounted, prep_cli, status_ranks, status_totals

from fanstore_fuse._format import MANIFEST_NAME
from fanstore_fuse._manifest import read_manifest
from fanstore_fuse._namespace import Namespace

KiB, MiB = 1 << 10, 1 << 20


def _text(n: int, seed: int) -> bytes:
    rng = random.Random(seed)
    words = [b"alpha", b"beta", b"gamma", b"delta", b"epsilon", b"zeta\n", b"0.125,", b"17,"]
    out = bytearray()
    while len(out) < n:
        out += rng.choice(words)
    return bytes(out[:n])


def _files(kind: str) -> dict[str, bytes]:
    """raw: incompressible; zstd: text (framed zstd frames for large files); dict: many small
    similar files (`--dict auto` trains a dictionary for them) and a few larger ones."""
    rng = random.Random(kind)
    body = (lambda n, i: rng.randbytes(n)) if kind == "raw" else (lambda n, i: _text(n, i))
    sizes = [0, 1, 4095, 4096, 100_000, 131_072, 300_000, 1 * MiB + 5, 3 * MiB + 12_345]
    files = {f"f/{i:02d}.bin": body(n, i) for i, n in enumerate(sizes)}
    if kind == "dict":
        for i in range(80):
            files[f"small/s{i:03d}.csv"] = _text(rng.randrange(2_000, 20_000), 1000 + i)
    return files


def _tree(root: Path, kind: str) -> tuple[Path, dict[str, bytes]]:
    files = _files(kind)
    src = root / f"src-{kind}"
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    return src, files


PREP = {"raw": ["--codec", "none"], "zstd": [], "dict": ["--dict", "auto"]}


def _prep(root: Path, kind: str, *extra: str) -> tuple[Path, Path, dict[str, bytes]]:
    src, files = _tree(root, kind)
    dest = prep_cli(src, root / f"dest-{kind}", "-p", "3", "--chunk-mib", "1",
                    "--frame-kib", "64", *PREP[kind], *extra)
    return src, dest, files


# ---------------------------------------------------------------------------- real mounts


def _odirect_ranges(size: int, frame: int = 64 * KiB, chunk: int = MiB) -> list[tuple[int, int]]:
    """4 KiB-aligned (offset, length) pairs: the start, frame and chunk boundaries straddled,
    random places, the tail."""
    if size == 0:
        return [(0, 4096)]
    out = [(0, 4096), (0, 128 * KiB)]
    for edge in list(range(frame, size, frame))[:6] + list(range(chunk, size, chunk)):
        out.append((edge - 4096, 8192))  # straddles it
    rng = random.Random(size)
    out += [(rng.randrange(0, size) // 4096 * 4096, rng.choice([4096, 12288, 200 * KiB]))
            for _ in range(12)]
    out.append((max(0, size - 5000) // 4096 * 4096, 8192))
    return out


def _read_odirect(path: Path, ranges: list[tuple[int, int]]) -> list[bytes]:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, 256 * KiB)
    try:
        got = []
        for off, n in ranges:
            k = os.preadv(fd, [memoryview(buf)[:n]], off)
            got.append(bytes(buf[:k]))
        return got
    finally:
        os.close(fd)
        buf.close()


def _check_files(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        assert (root / rel).read_bytes() == data, rel
        ranges = _odirect_ranges(len(data))
        for (off, n), got in zip(ranges, _read_odirect(root / rel, ranges)):
            assert got == data[off:off + n], (rel, off, n)


@pytest.mark.mount
@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["raw", "zstd", "dict"])
def test_one_rank_reads_every_file(tmp_path: Path, state_dir: Path, kind: str):
    _, dest, files = _prep(tmp_path, kind)
    with mounted(dest, tmp_path / "mnt", state_dir, local=tmp_path / "local") as m:
        _check_files(m.path, files)
        if kind == "raw":  # concurrent readers: threads at random ranges of every file
            def reader(seed: int) -> None:
                rng = random.Random(seed)
                for _ in range(150):
                    rel = rng.choice(list(files))
                    data = files[rel]
                    off = rng.randrange(0, max(1, len(data)))
                    n = rng.choice([1, 4096, 100_000, MiB + 3])
                    with open(m.path / rel, "rb") as f:
                        f.seek(off)
                        assert f.read(n) == data[off:off + n], (rel, off, n)
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(reader, range(8)))
        st = status_totals(m.status())
    assert st["local_reads"] >= len(files) - 1 and st["errors"] == 0, st  # (one is empty)


@pytest.mark.mount
@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["raw", "zstd"])
def test_corrupt_local_partition_gives_eio_and_a_log_line(tmp_path: Path, state_dir: Path,
                                                              kind: str):
    _, dest, files = _prep(tmp_path, kind)
    man = read_manifest(dest / MANIFEST_NAME)
    ns = Namespace(man)
    rel = "f/08.bin"  # 3 MiB + : chunks of 1 MiB, framed
    blobs = ns.blobs(ns.resolve(rel.encode()))
    small = "f/04.bin"  # 100,000 bytes: one whole blob
    (sblob,) = ns.blobs(ns.resolve(small.encode()))
    local = tmp_path / "local"
    with mounted(dest, tmp_path / "mnt", state_dir, local=local) as m:
        for b in (blobs[1], sblob):  # the middle of chunk 1, and the small file's only blob
            part = local / man.partitions[man.blobs["part"][b]].name
            with open(part, "r+b") as f:  # same inode: the daemon's descriptors see it
                pos = man.blobs["offset"][b] + man.blobs["stored"][b] // 2
                f.seek(pos)
                x = f.read(1)
                f.seek(pos)
                f.write(bytes([x[0] ^ 0x20]))
        for path in (m.path / rel, m.path / small):
            with pytest.raises(OSError) as ei:
                path.read_bytes()
            assert ei.value.errno == errno.EIO
        # Chunk 0 and other files still read.
        assert _read_odirect(m.path / rel, [(0, 8192)])[0] == files[rel][:8192]
        assert (m.path / "f/05.bin").read_bytes() == files["f/05.bin"]
        st = status_totals(m.status())
        m.umount()
        log = m.log_text()
    assert st["errors"] >= 2, st
    for name in (rel, small):
        assert [ln for ln in log.splitlines()
                if name in ln and ("checksum" in ln or "corrupt" in ln)], log[-3000:]


@pytest.mark.mount
@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_three_ranks_read_every_file(tmp_path: Path, state_dir: Path):
    _, dest, files = _prep(tmp_path, "dict")
    with mounted(dest, tmp_path / "mnt" / "{rank}", state_dir, ranks=3,
                 local=tmp_path / "local" / "{rank}") as m:
        for mp in m.mountpoints:
            _check_files(Path(mp), files)
        ranks = status_ranks(m.status())
    for r in ranks:  # every rank read its own blobs and the others' over MPI
        s = r["stats"]
        assert s["local_reads"] > 0 and s["remote_reads"] > 0 and s["errors"] == 0, r
