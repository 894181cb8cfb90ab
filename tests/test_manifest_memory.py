"""Hostile input must not exhaust memory (issue 15): each crafted DEST is refused by the real CLI
(`verify`, and `mount --foreground` where it applies) with the child's peak RSS at most 256 MB,
measured with `os.wait4` (ru_maxrss of exactly that child)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash
import zstandard
from _harness import cli_env, fuse_mounts
from _manifests import counts, rehead, sections

from fanstore_fuse import PrepOptions, prep
from fanstore_fuse._format import HASH_SEED, MANIFEST_MAGIC, MANIFEST_NAME, SECTIONS, checksum
from fanstore_fuse._manifest import _MANIFEST_HEADER, read_manifest, write_manifest

pytestmark = pytest.mark.fault
BUDGET = 256 << 20
GiB = 1 << 30


# Linux keeps a process's peak RSS across fork and exec: a child forked from pytest (hundreds of
# MB by the end of a full run) would report pytest's peak as its own. So a small launcher forks
# the CLI and reports the CLI's ru_maxrss from os.wait4 (the launcher's own ~10 MB is the floor).
LAUNCHER = """
import os, subprocess, sys
p = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
_, status, ru = os.wait4(p.pid, 0)
print(os.waitstatus_to_exitcode(status), ru.ru_maxrss * 1024)
"""


def run_measured(*args: str | os.PathLike[str], env: dict[str, str] | None = None,
                 timeout: float = 120) -> tuple[int, str, int]:
    """Run the CLI; return (exit status, stderr, peak RSS in bytes of the CLI process)."""
    r = subprocess.run([sys.executable, "-c", LAUNCHER, sys.executable, "-m", "fanstore_fuse",
                        *map(os.fspath, args)], env=env, stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=timeout)
    rc, peak = (int(x) for x in r.stdout.split())
    return rc, r.stderr, peak


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    b = tmp_path_factory.mktemp("memory")
    src = b / "src"
    (src / "d").mkdir(parents=True)
    (src / "a.txt").write_bytes(b"hello world " * 2000)  # compressible: stored as zstd
    (src / "d" / "b.bin").write_bytes(os.urandom(10000))
    prep(src, b / "dest", PrepOptions(partitions=2, chunk_size=4096, workers=1))
    return b


def _copy_dest(base: Path, where: Path) -> Path:
    where.mkdir()
    for p in (base / "dest").iterdir():
        (where / p.name).write_bytes(p.read_bytes())
    return where


def _refused(dest: Path, tmp_path: Path, msg: str, mount: bool = True) -> None:
    rc, err, peak = run_measured("verify", dest)
    assert rc != 0 and msg in err, err
    assert peak <= BUDGET, f"verify peaked at {peak >> 20} MiB"
    print(f"verify refused at peak RSS {peak >> 20} MiB: {err.strip()}")
    if not mount:
        return
    mp = tmp_path / "mp"
    mp.mkdir(exist_ok=True)
    state = tmp_path / "state"
    env = cli_env(state, COLUMNS="400")
    rc, err, peak = run_measured("mount", dest, mp, "--foreground", "--local", tmp_path / "local",
                                 env=env, timeout=60)
    assert rc != 0 and msg in err, err
    assert str(mp) not in fuse_mounts()
    assert peak <= BUDGET, f"mount peaked at {peak >> 20} MiB"
    print(f"mount refused at peak RSS {peak >> 20} MiB")


@pytest.mark.mount
@pytest.mark.timeout(120)
def test_manifest_with_a_4gib_hole_appended(base: Path, tmp_path: Path):
    d = _copy_dest(base, tmp_path / "d")
    with open(d / MANIFEST_NAME, "r+b") as f:
        f.truncate(os.fstat(f.fileno()).st_size + 4 * GiB)
    _refused(d, tmp_path, "header says")


def _zeros_digest(length: int) -> int:
    h = xxhash.xxh3_64(seed=HASH_SEED)
    block = bytes(64 << 20)
    left = length + (-length % 8)
    while left:
        k = min(left, len(block))
        h.update(memoryview(block)[:k])
        left -= k
    return h.intdigest()


@pytest.mark.timeout(180)
def test_sparse_manifest_consistent_with_its_header(base: Path, tmp_path: Path):
    """A 4.3 GB manifest that is all holes but whose header, table and every section checksum
    are valid (80M entries): the reader streams the checksums, then refuses the content."""
    d = _copy_dest(base, tmp_path / "d")
    good = (d / MANIFEST_NAME).read_bytes()
    meta = sections(good)["meta"]
    n = 80_000_000
    from fanstore_fuse._manifest import _expected_lengths, manifest_header

    lengths = [len(meta)] + [_expected_lengths(n, 0)[s][0] for s in SECTIONS[1:]]
    lengths[SECTIONS.index("names")] = n - 1
    digests = [xxhash.xxh3_64_intdigest(meta + bytes(-len(meta) % 8), seed=HASH_SEED)]
    cache: dict[int, int] = {}
    for ln in lengths[1:]:
        if ln not in cache:
            cache[ln] = _zeros_digest(ln)
        digests.append(cache[ln])
    head = manifest_header(n, 0, list(zip(lengths, digests)))
    size = int.from_bytes(head[16:24], "little")
    assert size > 4 * GiB
    with open(d / MANIFEST_NAME, "wb") as f:
        f.write(head)
        f.write(meta)
        f.truncate(size)
    _refused(d, tmp_path, "name table", mount=False)


@pytest.mark.mount
@pytest.mark.timeout(120)
@pytest.mark.parametrize("fields", [dict(entries=2**32 - 1), dict(blobs=2**36), dict(entries=2**40)])
def test_huge_counts_in_the_header(base: Path, tmp_path: Path, fields: dict):
    d = _copy_dest(base, tmp_path / "d")
    (d / MANIFEST_NAME).write_bytes(rehead((d / MANIFEST_NAME).read_bytes(), **fields))
    _refused(d, tmp_path, "manifest")


def _bomb(size: int, content_size: bool) -> bytes:
    c = zstandard.ZstdCompressor(level=1, write_content_size=content_size)
    obj = c.compressobj(size=size if content_size else -1)
    out = bytearray()
    block = bytes(64 << 20)
    for _ in range(size // len(block)):
        out += obj.compress(block)
    out += obj.flush()
    return bytes(out)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("content_size", [True, False])
@pytest.mark.parametrize("size, refused", [(4 * GiB, "zstd blob 0 stored size"), (64 << 20, "a.txt")])
def test_zstd_bomb_blob_with_valid_manifest(base: Path, tmp_path: Path, content_size: bool,
                                            size: int, refused: str):
    """Blob 0 (a zstd blob of a.txt, 4096 raw bytes) replaced by a frame that inflates to `size`;
    the manifest is rewritten so the bomb is exactly where it says (valid header and section
    checksums). The 4 GiB bomb (131 KB) is larger than the raw size, which validation refuses
    for a zstd blob; the 64 MiB one (2 KB) passes it and the decoder refuses it."""
    d = _copy_dest(base, tmp_path / "d")
    bomb = _bomb(size, content_size)
    assert len(bomb) < 1 << 20
    m = read_manifest(d / MANIFEST_NAME, writable=True)
    assert (len(bomb) < m.blobs["raw"][0]) == (refused == "a.txt")
    part = m.partitions[m.blobs["part"][0]]
    m.blobs["offset"][0] = part.size
    m.blobs["stored"][0] = len(bomb)
    with open(d / part.name, "ab") as f:
        f.write(bomb)
    part.size += len(bomb)
    write_manifest(d / MANIFEST_NAME, m)
    _refused(d, tmp_path, refused, mount=False)


def test_version_1_zstd_bomb_manifest(tmp_path: Path):
    """The issue's case: a version-1 manifest whose payload is a 4 GiB zstd bomb with a valid
    checksum. Version 2 has no compressed payload: the version is refused before anything."""
    payload = _bomb(4 * GiB, True)
    head = _MANIFEST_HEADER.size
    v1 = MANIFEST_MAGIC + (1).to_bytes(2, "little") + (1).to_bytes(2, "little") + bytes(4)
    v1 += len(payload).to_bytes(8, "little") + checksum(payload).to_bytes(8, "little")
    assert len(v1) == 32 < head
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / MANIFEST_NAME).write_bytes(v1 + payload)
    rc, err, peak = run_measured("verify", tmp_path / "d")
    assert rc != 0 and "re-run" in err and peak <= BUDGET, (err, peak)


def test_measure_is_real(base: Path):
    """The RSS measurement sees a child that allocates (300 MB reported as >= 300 MB) and not
    the parent's peak (a 400 MB parent does not make a small child look big)."""
    code = "b = bytearray(300 << 20); b[::4096] = b'x' * len(b[::4096])"
    r = subprocess.run([sys.executable, "-c", LAUNCHER, sys.executable, "-c", code],
                       capture_output=True, text=True, check=True)
    assert int(r.stdout.split()[1]) >= 300 << 20
    big = bytearray(400 << 20)
    big[::4096] = b"x" * len(big[::4096])
    rc, _, peak = run_measured("--help")
    del big
    assert rc == 0 and peak < 200 << 20, peak
    assert counts((base / "dest" / MANIFEST_NAME).read_bytes()) == (4, 9)
