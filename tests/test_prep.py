"""`prep` without FUSE: determinism, codecs, chunking, broadcast, odd inputs, scale, > 4 GiB."""

from __future__ import annotations

import logging
import os
import socket
import stat
import time
from pathlib import Path

import numpy as np
import pytest
from _harness import build_tree

from fanstore_fuse import FanstoreError, Namespace, PrepOptions, prep, read_manifest, verify
from fanstore_fuse._blobstore import BlobStore
from fanstore_fuse._format import (
    ALIGN_MIN,
    CODEC_RAW,
    CODEC_ZSTD,
    DATA_ALIGN,
    KIND_DIR,
    KIND_FILE,
    KIND_LINK,
    MANIFEST_NAME,
    PARTITION_DATA_START,
    data_lead,
)

K64 = 64 * 1024


def _read(dest: Path, rel: bytes) -> bytes:
    m = read_manifest(dest / MANIFEST_NAME)
    ns = Namespace(m)
    store = BlobStore(m, str(dest))
    try:
        return b"".join(store.raw(b) for b in ns.blobs(ns.resolve(rel)))
    finally:
        store.close()


def _files(dest: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(dest.iterdir())}


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tree(tmp_path_factory.mktemp("prep") / "src", chunk=K64)


def test_deterministic_output(tree: Path, tmp_path: Path):
    outs = []
    for k, workers in enumerate((1, 2, 4, 1)):
        dest = tmp_path / f"dest{k}"
        prep(tree, dest, PrepOptions(partitions=3, chunk_size=K64, workers=workers,
                                     broadcast=["classes/class_2"]))
        outs.append(_files(dest))
    assert all(o == outs[0] for o in outs[1:])
    assert set(outs[0]) == {"manifest.fsm", "part-00000.fsp", "part-00001.fsp", "part-00002.fsp",
                            "bcast-00003.fsp"}
    # Different options -> a different dataset (id in every partition header).
    prep(tree, tmp_path / "other", PrepOptions(partitions=3, chunk_size=K64, level=5))
    assert _files(tmp_path / "other")["manifest.fsm"] != outs[0]["manifest.fsm"]
    assert not list(tmp_path.glob("*/*.tmp*"))


def test_codecs(tree: Path, tmp_path: Path):
    none = prep(tree, tmp_path / "none", PrepOptions(codec="none", chunk_size=K64))
    z = prep(tree, tmp_path / "zstd", PrepOptions(codec="zstd", chunk_size=K64, level=19))
    b = none.manifest.blobs
    assert set(b["codec"]) == {CODEC_RAW}
    assert list(b["stored"]) == list(b["raw"])
    assert none.stored_bytes == none.raw_bytes == z.raw_bytes
    zb = z.manifest.blobs
    assert set(zb["codec"]) == {CODEC_RAW, CODEC_ZSTD}  # random data stays raw
    for j in range(z.manifest.n_blobs):
        if zb["codec"][j] == CODEC_ZSTD:
            assert zb["stored"][j] < zb["raw"][j]
        else:
            assert zb["stored"][j] == zb["raw"][j]
    assert z.stored_bytes < z.raw_bytes
    zeros = (tree / "zeros.bin").read_bytes()
    for dest in (tmp_path / "none", tmp_path / "zstd"):
        assert _read(dest, b"zeros.bin") == zeros
        assert _read(dest, b"big.bin") == (tree / "big.bin").read_bytes()
        assert verify(str(dest)).ok
    assert z.manifest.options["codec"] == "zstd" and z.manifest.options["level"] == 19


def test_chunking(tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(3 * K64 + 5)
    (src / "f").write_bytes(data)
    (src / "exact").write_bytes(os.urandom(2 * K64))
    res = prep(src, tmp_path / "dest", PrepOptions(partitions=2, chunk_size=K64, codec="none"))
    m = res.manifest
    ns = Namespace(m)
    i = ns.resolve(b"f")
    assert [m.blobs["raw"][b] for b in ns.blobs(i)] == [K64, K64, K64, 5]
    assert [m.blobs["raw"][b] for b in ns.blobs(ns.resolve(b"exact"))] == [K64, K64]
    assert _read(tmp_path / "dest", b"f") == data
    assert m.options["chunk_size"] == K64
    # A file's blobs are contiguous ids; each lies inside its partition after the header.
    for j in range(m.n_blobs):
        assert m.blobs["offset"][j] >= PARTITION_DATA_START
        p = m.partitions[m.blobs["part"][j]]
        assert m.blobs["offset"][j] + m.blobs["stored"][j] <= p.size
        assert os.path.getsize(tmp_path / "dest" / p.name) == p.size


def test_broadcast_globs(tree: Path, tmp_path: Path):
    res = prep(tree, tmp_path / "dest", PrepOptions(
        partitions=2, chunk_size=K64, broadcast=["classes/class_1", "*.sh", "a/*/c/deep.txt"]))
    m = res.manifest
    ns = Namespace(m)
    bc = [k for k, p in enumerate(m.partitions) if p.broadcast]
    assert len(bc) == 1 and m.partitions[bc[0]].name == "bcast-00002.fsp"
    in_bcast = set()
    for i in range(len(ns)):
        blobs = ns.blobs(i)
        if blobs and all(m.blobs["part"][b] == bc[0] for b in blobs):
            in_bcast.add(ns.path(i))
    want = {p for p in (ns.path(i) for i in range(len(ns)) if ns.record(i).kind == KIND_FILE
                        and ns.record(i).size)
            if p.startswith(b"classes/class_1/") or p.endswith(b".sh") or p == b"a/b/c/deep.txt"}
    assert in_bcast == want
    import struct

    with open(tmp_path / "dest" / "bcast-00002.fsp", "rb") as f:
        _magic, _ver, flags, idx = struct.unpack("<8sHHI", f.read(16))
    assert flags == 1 and idx == 2
    # No globs: no broadcast partition.
    res2 = prep(tree, tmp_path / "d2", PrepOptions(partitions=2, chunk_size=K64, broadcast=["nomatch"]))
    assert not any(p.broadcast for p in res2.manifest.partitions)


def test_odd_entries(tree: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture):
    (tree / "sock-dir").mkdir(exist_ok=True)
    sock_path = tree / "sock-dir" / "s"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock_path))
    try:
        with caplog.at_level(logging.WARNING, logger="fanstore_fuse.prep"):
            res = prep(tree, tmp_path / "dest", PrepOptions(chunk_size=K64))
    finally:
        s.close()
        sock_path.unlink()
        (tree / "sock-dir").rmdir()
    assert res.skipped == 2  # the fifo and the socket, one warning each
    warns = [r.getMessage() for r in caplog.records if "skipping special file" in r.getMessage()]
    assert len(warns) == 2 and any("fifo" in w for w in warns) and any("sock-dir/s" in w for w in warns)
    m = res.manifest
    ns = Namespace(m)
    assert res.symlinks == 6
    rb = os.fsencode(tree)
    for rel in (b"bad-\xff\xfe-name.bin", b"new\nline", "ünïcødé-日本.txt".encode(), b"x" * 255):
        assert _read(tmp_path / "dest", rel) == open(os.path.join(rb, rel), "rb").read()
    i = ns.resolve(b"link-\xff")
    assert ns.record(i).kind == KIND_LINK and ns.readlink(i) == b"\xff-target"
    assert ns.readlink(ns.resolve(b"dangling")) == b"does/not/exist"
    assert ns.record(ns.resolve(b"dangling")).size == len(b"does/not/exist")
    # setuid/setgid dropped, other bits (sticky, exec, 0444) kept.
    assert stat.S_IMODE(ns.record(ns.resolve(b"setuid")).mode) == 0o755
    assert stat.S_IMODE(ns.record(ns.resolve(b"setgid")).mode) == 0o750
    assert stat.S_IMODE(ns.record(ns.resolve(b"sticky")).mode) == 0o1777
    assert stat.S_IMODE(ns.record(ns.resolve(b"readonly")).mode) == 0o444
    # Empty file and empty directory.
    e = ns.record(ns.resolve(b"empty"))
    assert (e.kind, e.size, e.count) == (KIND_FILE, 0, 0)
    d = ns.record(ns.resolve(b"empty dir"))
    assert (d.kind, d.count, d.nlink) == (KIND_DIR, 0, 2)
    assert _read(tmp_path / "dest", b"empty") == b""
    if os.getuid() == 0:
        r = ns.record(ns.resolve(b"classes/class_1/img_001.bin"))
        assert (r.uid, r.gid) == (1234, 5678)
    st = os.lstat(tree / "rel-link")
    r = ns.record(ns.resolve(b"rel-link"))
    assert (r.uid, r.gid, r.mtime_ns) == (st.st_uid, st.st_gid, st.st_mtime_ns)


def test_empty_source(tmp_path: Path):
    (tmp_path / "src").mkdir()
    res = prep(tmp_path / "src", tmp_path / "dest", PrepOptions(partitions=2))
    assert res.files == 0 and res.manifest.n_entries == 1 and res.manifest.n_blobs == 0
    assert verify(str(tmp_path / "dest")).ok


def test_bad_inputs(tmp_path: Path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(FanstoreError, match="not a directory"):
        prep(tmp_path / "file", tmp_path / "dest")
    with pytest.raises(FileNotFoundError):
        prep(tmp_path / "missing", tmp_path / "dest")
    for opts, msg in [
        (PrepOptions(partitions=0), "partitions"),
        (PrepOptions(codec="lz4"), "codec"),
        (PrepOptions(level=99), "level"),
        (PrepOptions(chunk_size=100), "chunk"),
        (PrepOptions(chunk_size=128 << 20), "chunk"),
    ]:
        with pytest.raises(FanstoreError, match=msg):
            prep(tmp_path, tmp_path / "dest", opts)


def test_partitions_balance(tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    for k in range(64):
        (src / f"f{k:03d}").write_bytes(os.urandom(10_000))
    res = prep(src, tmp_path / "dest", PrepOptions(partitions=4, codec="none"))
    m = res.manifest
    stored = [sum(int(m.blobs["stored"][j]) for j in range(m.n_blobs) if m.blobs["part"][j] == p)
              for p in range(4)]
    assert stored == [160_000] * 4
    # each partition: its blobs, each with its data on a 64-byte boundary (< 64 bytes of padding)
    sizes = [p.size - PARTITION_DATA_START for p in m.partitions]
    assert all(160_000 <= s < 160_000 + 16 * DATA_ALIGN for s in sizes)
    assert all(int(o) % DATA_ALIGN == 0 for o in m.blobs["offset"])


def test_blob_data_starts_on_64_byte_boundaries(tmp_path: Path):
    """Blobs of ALIGN_MIN stored bytes or more have their first raw data byte (after a raw-framed
    blob's frame table) on a DATA_ALIGN boundary; smaller ones are packed; every byte reads back,
    and a rank's dense copy keeps each offset modulo DATA_ALIGN."""
    from fanstore_fuse._stage import plan_dense, stage_in

    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(5)
    want = {}
    for k in range(40):
        size = [37, 1000, 5_001, 70_003, 1 << 20][k % 5] + k
        data = rng.bytes(size) if k % 2 else bytes(size // 7) * 7 + rng.bytes(size % 7)
        want[f"f{k:02d}"] = data
        (src / f"f{k:02d}").write_bytes(data)
    dest = tmp_path / "dest"
    m = prep(src, dest, PrepOptions(partitions=3, chunk_size=512 << 10)).manifest
    b = m.blobs
    big = [j for j in range(m.n_blobs) if b["stored"][j] >= ALIGN_MIN]
    leads = {data_lead(int(b["codec"][j]), int(b["stored"][j]), int(b["raw"][j])) for j in big}
    assert len(big) >= 12 and max(leads) > 0  # raw-framed blobs among them
    for j in big:
        lead = data_lead(int(b["codec"][j]), int(b["stored"][j]), int(b["raw"][j]))
        assert (int(b["offset"][j]) + lead) % DATA_ALIGN == 0
    for name, data in want.items():
        assert _read(dest, name.encode()) == data
    held = np.arange(1, m.n_blobs, 2)  # every other blob: gaps between a rank's blobs
    shares, dense = plan_dense(m, held)
    for j, local in zip(dense.ids, dense.offs):
        if b["stored"][j] >= ALIGN_MIN:
            assert local % DATA_ALIGN == int(b["offset"][j]) % DATA_ALIGN
    for p, r in shares.items():  # the ranges' padding never exceeds DATA_ALIGN - 1 a blob
        mine = [int(b["stored"][j]) for j in held if b["part"][j] == p]
        assert sum(mine) <= int(r[:, 1].sum()) < sum(mine) + DATA_ALIGN * len(mine)
    stage_in(str(dest), str(tmp_path / "local"), m, shares)
    store = BlobStore(m, str(tmp_path / "local"), dense)
    full = BlobStore(m, str(dest))
    try:
        assert all(store.raw(int(j)) == full.raw(int(j)) for j in held)
    finally:
        store.close()
        full.close()


@pytest.mark.timeout(120)
def test_directory_with_many_entries(tmp_path: Path):
    src = tmp_path / "src"
    big = src / "many"
    big.mkdir(parents=True)
    n = 20_000
    for k in range(n):
        open(big / f"e{k:06d}", "wb").close()
    (src / "after").write_bytes(b"x")
    t0 = time.perf_counter()
    res = prep(src, tmp_path / "dest", PrepOptions(partitions=2))
    dt = time.perf_counter() - t0
    assert res.files == n + 1
    m = read_manifest(tmp_path / "dest" / MANIFEST_NAME)
    ns = Namespace(m)
    d = ns.resolve(b"many")
    assert ns.record(d).count == n
    assert ns.lookup(d, b"e012345") == ns.children(d)[12345]
    assert ns.path(ns.resolve(b"many/e019999")) == b"many/e019999"
    assert _read(tmp_path / "dest", b"after") == b"x"
    assert dt < 30, f"prep of {n} entries took {dt:.1f} s"


@pytest.mark.timeout(180)
def test_file_larger_than_4gib(huge_dest):
    """A sparse 4.5 GiB file (zeros compress fast) with 64 MiB chunks (conftest `huge_dest`):
    sizes and offsets past 2**32 survive, and chunks read back exactly."""
    dest, size, res, dt = huge_dest
    chunk = 64 << 20
    m = res.manifest
    ns = Namespace(m)
    i = ns.resolve(b"huge")
    r = ns.record(i)
    assert r.size == size and r.count == -(-size // chunk)
    assert res.stored_bytes < 64 << 20  # zeros compress
    store = BlobStore(m, str(dest))
    try:
        blobs = ns.blobs(i)
        k4 = (4 << 30) // chunk
        assert store.raw(blobs[k4])[:8] == b"at 4 GiB"
        last = store.raw(blobs[-1])
        assert len(last) == size - (r.count - 1) * chunk and last.endswith(b"tail!")
        assert store.raw(blobs[0]) == bytes(chunk)
    finally:
        store.close()
    print(f"4.5 GiB sparse prep: {dt:.1f} s")


def test_dest_inside_src_is_left_out(tmp_path: Path, caplog):
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "x.txt").write_bytes(b"x" * 100)
    dest = src / "prepped"
    with caplog.at_level("WARNING"):
        prep(src, dest, PrepOptions(partitions=2))
    ns = Namespace(read_manifest(dest / MANIFEST_NAME))
    paths = {ns.path(i) for i in range(len(ns))}
    assert paths == {b"", b"a", b"a/x.txt"}
    assert "output directory" in caplog.text


def test_reprep_with_fewer_partitions_removes_stale_ones(tmp_path: Path):
    src = tmp_path / "src"
    src.mkdir()
    for k in range(8):
        (src / f"f{k}").write_bytes(bytes([k]) * 5000)
    dest = tmp_path / "dest"
    prep(src, dest, PrepOptions(partitions=6))
    assert len(list(dest.glob("part-*.fsp"))) == 6
    prep(src, dest, PrepOptions(partitions=2))
    assert sorted(p.name for p in dest.glob("*.fsp")) == ["part-00000.fsp", "part-00001.fsp"]
    assert verify(str(dest)).ok


def test_path_over_path_max_is_skipped_with_a_warning(tmp_path: Path, caplog):
    """mksquashfs-like: an entry whose source path reaches PATH_MAX is left out with a warning;
    everything else is packed (before, prep failed as a whole with ENAMETOOLONG)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok.txt").write_bytes(b"fine")
    fd = os.open(src, os.O_RDONLY)
    depth = 0
    try:
        while len(os.fsencode(src)) + depth * 201 < 4200:  # build below PATH_MAX with dir fds
            os.mkdir("d" * 200, dir_fd=fd)
            nfd = os.open("d" * 200, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = nfd
            depth += 1
            with open(os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "wb") as f:
                f.write(b"x" * depth)
    finally:
        os.close(fd)
    with caplog.at_level(logging.WARNING, logger="fanstore_fuse.prep"):
        res = prep(src, tmp_path / "dest", PrepOptions(partitions=1))
    assert res.skipped >= 1
    assert any("PATH_MAX" in r.getMessage() for r in caplog.records)
    assert _read(tmp_path / "dest", b"ok.txt") == b"fine"
    deep = b"/".join([b"d" * 200] * 3) + b"/leaf"
    assert _read(tmp_path / "dest", deep) == b"xxx"
    assert verify(str(tmp_path / "dest")).ok
