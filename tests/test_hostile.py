"""Hostile input: crafted manifests are refused before mounting; dataset symlinks never escape.

Every hostile manifest here is made with the library itself (a real manifest from `prep`, columns
mutated, re-encoded with `encode_manifest`), so its checksum is valid and only the validation
stands between it and the mount. Expected outcome for each: `read_manifest` raises FormatError
with a message naming the problem; through the real `mount` CLI: exit code != 0, one line on
stderr starting with `fanstore-fuse:`, nothing mounted, no daemon, no state file, no local copy.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import time
from array import array
from pathlib import Path

import pytest
from _harness import cli_env, fuse_mounts, mounted, run_cli
from _manifests import build, counts, rehead, sections

from fanstore_fuse import FormatError, PrepOptions, prep
from fanstore_fuse._format import (
    FORMAT_VERSION,
    KIND_DIR,
    KIND_FILE,
    KIND_LINK,
    MANIFEST_NAME,
    PARTITION_DATA_START,
    Manifest,
    PartitionInfo,
)
from fanstore_fuse._manifest import decode_manifest, encode_manifest, read_manifest

pytestmark = pytest.mark.fault

SRC_FILES = {
    b"a.txt": b"alpha\n" * 50,
    b"b.txt": b"bravo\n" * 70,
    b"c.bin": bytes(range(256)) * 40,
    b"sub/d.txt": b"delta\n" * 30,
    b"sub/deeper/e.txt": b"echo\n",
}


@pytest.fixture(scope="module")
def dest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("hostile")
    src = base / "src"
    for rel, data in SRC_FILES.items():
        p = src / os.fsdecode(rel)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    os.symlink("a.txt", src / "link")
    prep(src, base / "dest", PrepOptions(partitions=2, codec="zstd", chunk_size=4096, workers=1))
    return base / "dest"


def _load(dest: Path) -> Manifest:
    return read_manifest(dest / MANIFEST_NAME, writable=True)


def _idx(m: Manifest, path: bytes) -> int:
    return next(i for i in range(m.n_entries) if m.path(i) == path)


def _rename(m: Manifest, i: int, new: bytes) -> None:
    """Replace entry i's name, keeping the name table consistent."""
    names = [m.name(j) for j in range(m.n_entries)]
    names[i] = new
    off = array("Q", [0])
    for nm in names:
        off.append(off[-1] + len(nm))
    m.names, m.name_off = b"".join(names), off


def _set(col: str, path: bytes, value):
    def mutate(m: Manifest) -> None:
        m.entries[col][_idx(m, path)] = value(m) if callable(value) else value
    return mutate


def _set_blob(col: str, value):
    def mutate(m: Manifest) -> None:
        m.blobs[col][0] = value(m) if callable(value) else value
    return mutate


def _name(path: bytes, new: bytes):
    return lambda m: _rename(m, _idx(m, path), new)


def _part(i: int, name: str):
    return lambda m: setattr(m.partitions[i], "name", name)


def _link_target(target: bytes):
    def mutate(m: Manifest) -> None:
        i = _idx(m, b"link")
        m.entries["first"][i] = len(m.links)
        m.entries["size"][i] = len(target)
        m.links = bytes(m.links) + target
    return mutate


def _file_blob(path: bytes, k: int = 0):
    """Blob k of the file at `path` (its index in the blob table)."""
    return lambda m: int(m.entries["first"][_idx(m, path)]) + k


def _set_file_blob(path: bytes, k: int, **cols):
    def mutate(m: Manifest) -> None:
        j = _file_blob(path, k)(m)
        for col, value in cols.items():
            m.blobs[col][j] = value(m, j) if callable(value) else value
    return mutate


def _meta_partition(i: int, value):
    return lambda m: setattr(m.partitions[i], "size", value)


HOSTILE = {
    # names
    "name-dotdot": (_name(b"a.txt", b".."), "unsafe name"),
    "name-dot": (_name(b"a.txt", b"."), "unsafe name"),
    "name-slash": (_name(b"a.txt", b"a/b"), "unsafe name"),
    "name-absolute": (_name(b"c.bin", b"/etc/passwd"), "unsafe name|unsorted"),
    "name-escape": (_name(b"c.bin", b"../../../etc/shadow"), "unsafe name|unsorted"),
    "name-empty": (_name(b"a.txt", b""), "unsafe name"),
    "name-nul": (_name(b"a.txt", b"a\0b"), "unsafe name"),
    "name-too-long": (_name(b"c.bin", b"x" * 256), "unsafe name|unsorted"),
    "duplicate-entry": (_name(b"b.txt", b"a.txt"), "duplicate"),
    "unsorted-dir": (_name(b"a.txt", b"zzz"), "unsorted"),
    "name-table-decreasing": (
        lambda m: m.name_off.__setitem__(2, m.name_off[3] + 1), "name table|unsafe"),
    # structure: cycles and backwards ranges
    "parent-self": (_set("parent", b"sub", lambda m: _idx(m, b"sub")), "parent"),
    "parent-later": (_set("parent", b"a.txt", lambda m: m.n_entries - 1), "parent"),
    "parent-is-file": (_set("parent", b"sub/d.txt", lambda m: _idx(m, b"a.txt")), "parent"),
    "children-backwards": (_set("first", b"sub", 1), "cycle"),
    "children-self": (_set("first", b"sub", lambda m: _idx(m, b"sub")), "cycle"),
    "children-beyond": (_set("count", b"sub", 10_000), "range|cycle"),
    "root-lists-root": (lambda m: m.entries["first"].__setitem__(0, 0), "cycle|parent"),
    "root-not-dir": (lambda m: m.entries["kind"].__setitem__(0, KIND_FILE), "root"),
    # modes and kinds
    "setuid-file": (_set("mode", b"a.txt", stat.S_IFREG | stat.S_ISUID | 0o755), "setuid"),
    "setgid-dir": (_set("mode", b"sub", stat.S_IFDIR | stat.S_ISGID | 0o755), "setgid"),
    "device-node": (_set("mode", b"a.txt", stat.S_IFCHR | 0o666), "mismatch"),
    "unknown-kind": (_set("kind", b"a.txt", 9), "kind"),
    "dir-as-link": (_set("kind", b"sub", KIND_LINK), "mismatch"),
    # sizes, blobs, partitions
    "size-larger-than-blobs": (_set("size", b"a.txt", lambda m: 10**9), "does not match"),
    "size-smaller-than-blobs": (_set("size", b"c.bin", 1), "does not match"),
    "blobs-beyond-table": (_set("first", b"c.bin", lambda m: m.n_blobs), "beyond"),
    "blob-offset-huge": (_set_blob("offset", 2**60), "outside"),
    "blob-offset-in-header": (_set_blob("offset", 8), "outside"),
    "blob-past-partition-end": (
        _set_blob("offset", lambda m: m.partitions[m.blobs["part"][0]].size - 1), "outside"),
    "blob-partition-missing": (_set_blob("part", 7), "partition"),
    "blob-raw-over-chunk": (_set_blob("raw", 1 << 30), "chunk|match"),
    "blob-unknown-codec": (_set_blob("codec", 77), "codec"),
    "partition-dotdot": (_part(0, "../x"), "unsafe"),
    "partition-absolute": (_part(0, "/etc/passwd"), "unsafe"),
    "partition-dot": (_part(0, "."), "unsafe"),
    "partition-empty": (_part(0, ""), "unsafe"),
    "partition-nul": (_part(0, "a\0b"), "unsafe"),
    "partition-manifest": (_part(0, MANIFEST_NAME), "unsafe"),
    "partition-marker": (_part(0, ".fanstore-local"), "unsafe"),
    "partition-duplicate": (_part(1, "part-00000.fsp"), "duplicate"),
    "partition-tiny": (lambda m: setattr(m.partitions[0], "size", 3), "too small"),
    "chunk-size-huge": (lambda m: m.options.__setitem__("chunk_size", 1 << 40), "chunk"),
    # chunk sizes: every blob but a file's last holds exactly chunk_size raw bytes (c.bin has
    # three blobs of 4096, 4096, 2048 bytes; its raw sizes moved keep the file's sum)
    "chunk-short-not-last": (_set_file_blob(b"c.bin", 0, raw=2048), "every blob but a file's last"),
    "chunk-short-middle": (
        lambda m: [_set_file_blob(b"c.bin", 1, raw=2048)(m), _set_file_blob(b"c.bin", 2, raw=4096)(m)],
        "every blob but a file's last"),
    "blob-empty": (_set_file_blob(b"sub/deeper/e.txt", 0, raw=0, stored=0), "empty"),
    # stored vs raw sizes, per codec
    "raw-stored-differs": (_set_file_blob(b"sub/deeper/e.txt", 0, stored=4), "stored size differs"),
    "zstd-stored-not-smaller": (_set_file_blob(b"c.bin", 0, stored=4096), "zstd blob"),
    "zstd-stored-zero": (_set_file_blob(b"c.bin", 0, stored=0), "zstd blob"),
    "framed-over-table-bound": (
        _set_file_blob(b"c.bin", 0, codec=3, stored=4096 + 8 + 12 + 1), "framed blob .* exceeds"),
    "framed-stored-4gib": (_set_file_blob(b"c.bin", 0, codec=3, stored=2**32 - 1), "framed blob .* exceeds"),
    "framed-too-short": (_set_file_blob(b"c.bin", 0, codec=3, stored=20), "too short"),
    # the root's name, symlink counts
    "root-named": (lambda m: _rename(m, 0, b"r"), "root"),
    "link-with-count": (_set("count", b"link", 3), "symlink entry .* count"),
    # partition names follow their index; only the last may be the broadcast one
    "partition-misnumbered": (
        lambda m: [_part(0, "part-00001.fsp")(m), _part(1, "part-00000.fsp")(m)], "expected"),
    "partition-bcast-not-last": (
        lambda m: [_part(0, "bcast-00000.fsp")(m), setattr(m.partitions[0], "broadcast", True)],
        "expected"),
    "partition-flag-without-bcast-name": (
        lambda m: setattr(m.partitions[1], "broadcast", True), "expected"),
    # meta types
    "chunk-size-string": (lambda m: m.options.__setitem__("chunk_size", "4096"), "chunk size"),
    "chunk-size-float": (lambda m: m.options.__setitem__("chunk_size", 4096.5), "chunk size"),
    "dataset-id-negative": (lambda m: setattr(m, "dataset_id", -1), "dataset_id"),
    "options-not-a-map": (lambda m: setattr(m, "options", [1, 2]), "options"),
    "partition-size-string": (_meta_partition(0, "123456"), "partition 0 is not \\["),
    # symlinks
    "link-target-nul": (_link_target(b"/etc/\0passwd"), "symlink"),
    "link-target-empty": (_set("size", b"link", 0), "symlink"),
    "link-target-beyond": (_set("first", b"link", 10**9), "symlink"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_manifest_refused(dest: Path, case: str):
    mutate, msg = HOSTILE[case]
    m = _load(dest)
    mutate(m)
    data = encode_manifest(m)
    with pytest.raises(FormatError, match=msg):
        decode_manifest(data)


# ---------------------------------------------------------------- raw header cases


@pytest.mark.parametrize(
    "fields, msg",
    [
        (dict(entries=2**40), "out of range"),
        (dict(entries=2**31), "bytes, expected"),  # in range, but the columns are short
        (dict(entries=0), "out of range"),
        (dict(blobs=2**41), "out of range"),
        (dict(blobs=2**30), "bytes, expected"),
        (dict(version=FORMAT_VERSION + 1), "version"),
        (dict(size=2**62), "header says"),
    ],
)
def test_hostile_header_refused(dest: Path, fields: dict, msg: str):
    data = (dest / MANIFEST_NAME).read_bytes()
    t0 = time.monotonic()
    with pytest.raises(FormatError, match=msg):
        decode_manifest(rehead(data, **fields))
    assert time.monotonic() - t0 < 2  # refused at once, nothing allocated for the claimed size


def test_wrong_version_and_bad_checksum(dest: Path):
    good = (dest / MANIFEST_NAME).read_bytes()
    with pytest.raises(FormatError, match="version"):
        decode_manifest(rehead(good, version=FORMAT_VERSION + 1))
    with pytest.raises(FormatError, match="version"):
        decode_manifest(rehead(good, version=0))
    bad = bytearray(good)
    bad[-5] ^= 0x10
    with pytest.raises(FormatError, match="checksum"):
        decode_manifest(bytes(bad))
    with pytest.raises(FormatError, match="checksum"):
        decode_manifest(good[:48] + bytes(len(good) - 48))


def test_quadratic_blob_ranges_validate_in_linear_time():
    """Many files all claiming the whole blob table: validation must not be O(files x blobs)."""
    n_files = nb = 20_000
    names = [b"f%06d" % i for i in range(n_files)]
    off = array("Q", [0])
    for nm in [b"", *names]:
        off.append(off[-1] + len(nm))
    n = n_files + 1
    entries = {
        "parent": array("I", [0] * n),
        "kind": array("B", [KIND_DIR] + [KIND_FILE] * n_files),
        "mode": array("I", [stat.S_IFDIR | 0o755] + [stat.S_IFREG | 0o644] * n_files),
        "uid": array("I", [0] * n),
        "gid": array("I", [0] * n),
        "mtime_ns": array("q", [0] * n),
        "size": array("Q", [0] + [nb] * n_files),
        "first": array("Q", [1] + [0] * n_files),
        "count": array("I", [n_files] + [nb] * n_files),
    }
    blobs = {
        "part": array("I", [0] * nb),
        "offset": array("Q", [PARTITION_DATA_START + i for i in range(nb)]),
        "stored": array("I", [1] * nb),
        "raw": array("I", [1] * nb),
        "codec": array("B", [0] * nb),
        "xxh3": array("Q", [0] * nb),
    }
    m = Manifest(7, {"chunk_size": 4096}, [PartitionInfo("part-00000.fsp", PARTITION_DATA_START + nb)],
                 entries, off, b"".join(names), b"", blobs)
    data = encode_manifest(m)
    t0 = time.monotonic()
    with pytest.raises(FormatError, match="tile"):  # version 2: every blob belongs to one file
        decode_manifest(data)
    assert time.monotonic() - t0 < 10


# ---------------------------------------------------------------- through the real CLI


def _hostile_dest(dest: Path, where: Path, mutate) -> Path:
    shutil.copytree(dest, where)
    if mutate is not None:
        m = _load(dest)
        mutate(m)
        (where / MANIFEST_NAME).write_bytes(encode_manifest(m))
    return where


@pytest.mark.mount
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["name-escape", "partition-dotdot", "setuid-file", "cycle-raw",
                                  "huge-count", "bad-checksum"])
def test_mount_cli_refuses_hostile_manifest(dest: Path, tmp_path: Path, state_dir: Path, case: str):
    if case in HOSTILE:
        d = _hostile_dest(dest, tmp_path / "d", HOSTILE[case][0])
    else:
        d = _hostile_dest(dest, tmp_path / "d", None)
        if case == "bad-checksum":
            raw = bytearray((d / MANIFEST_NAME).read_bytes())
            raw[40] ^= 1
            (d / MANIFEST_NAME).write_bytes(bytes(raw))
        else:
            data = (dest / MANIFEST_NAME).read_bytes()
            if case == "huge-count":
                data = rehead(data, entries=2**40)
            else:  # cycle: a directory's children start at the directory itself
                m = _load(dest)
                first = array("Q", m.entries["first"])
                first[_idx(m, b"sub")] = _idx(m, b"sub")
                data = build({**sections(data), "entries.first": first.tobytes()}, *counts(data))
            (d / MANIFEST_NAME).write_bytes(data)
    mp = tmp_path / "mp"
    mp.mkdir()
    local = tmp_path / "local"
    # COLUMNS: cli._fail prints through rich, which wraps long lines at 80 columns when stderr is
    # not a terminal (known, see tests/test_mount.py); a wide console keeps the message one line.
    r = run_cli("mount", d, mp, "--local", local, env=cli_env(state_dir, COLUMNS="400"),
                check=False, timeout=60)
    assert r.returncode != 0, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fanstore-fuse:"), r.stderr
    assert "Traceback" not in r.stderr
    assert str(mp) not in fuse_mounts()
    assert os.listdir(mp) == []
    assert not local.exists() or os.listdir(local) == []
    assert not list(state_dir.glob("*.json"))


# ---------------------------------------------------------------- symlinks in the dataset


LINKS = {
    b"abs-passwd": b"/etc/passwd",
    b"up3": b"../../..",
    b"up-shadow": b"../../../../../../etc/shadow",
    b"proc-self": b"/proc/self/root/etc/hostname",
    b"inside": b"../../file.txt",
}


def _daemon_files(pid: int) -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            t = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if t.startswith("/"):
            out.append(t)
    return out


@pytest.mark.mount
@pytest.mark.timeout(120)
def test_symlinks_are_served_verbatim_and_never_escape(tmp_path: Path, state_dir: Path):
    src = tmp_path / "src"
    (src / "d1" / "d2").mkdir(parents=True)
    (src / "file.txt").write_bytes(b"inside the mount\n")
    for name, target in LINKS.items():
        os.symlink(target, os.path.join(os.fsencode(src / "d1" / "d2"), name))
    dest = tmp_path / "dest"
    prep(src, dest, PrepOptions(partitions=1, workers=1))
    local = tmp_path / "local"
    with mounted(dest, tmp_path / "mp", state_dir, local=local) as m:
        (pid,) = [p for p in m.pids() if p]
        base = os.fsencode(m.path / "d1" / "d2")
        assert (m.path / "file.txt").read_bytes() == b"inside the mount\n"
        assert open(os.path.join(base, b"inside"), "rb").read() == b"inside the mount\n"
        for name, target in LINKS.items():
            p = os.path.join(base, name)
            st = os.lstat(p)
            assert stat.S_ISLNK(st.st_mode) and st.st_size == len(target)
            assert os.readlink(p) == target
            # The link itself has no data: opening it without following fails.
            with pytest.raises(OSError):
                os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
        # Following an absolute link is resolved by the kernel on the client side: it reads the
        # client's /etc/passwd, never anything the daemon opened on its behalf.
        with open(os.path.join(base, b"abs-passwd"), "rb") as f:
            assert f.read() == Path("/etc/passwd").read_bytes()
        # `../../..` from d1/d2 walks up past the mount root into the host tree, again client-side.
        assert os.path.realpath(os.path.join(base, b"up3")) == os.fsencode(tmp_path)
        # The daemon only ever has its local copy, its log, and /dev/fuse open.
        allowed = (os.fspath(local) + "/", os.fspath(state_dir) + "/", "/dev/", "/proc/")
        opened = _daemon_files(pid)
        assert any(t.startswith(os.fspath(local) + "/") for t in opened), opened
        bad = [t for t in opened if not t.startswith(allowed) and "pipe:" not in t]
        assert not bad, bad
        assert not any("passwd" in t or "shadow" in t or "hostname" in t for t in opened)
        m.umount()
    assert m.forced == []


# ---------------------------------------------------------------- chunk sizes, frames, bounds


@pytest.fixture(scope="module")
def framed_dest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One file of 1200 KiB in chunks of 1 MiB: blob 0 framed (16 frames of 64 KiB), blob 1 of
    176 KiB; and a few small files."""
    base = tmp_path_factory.mktemp("framed")
    src = base / "src"
    src.mkdir()
    (src / "big").write_bytes(b"".join(b"line %08d of a compressible file\n" % i
                                       for i in range(1200 * 1024 // 34 + 1))[: 1200 * 1024])
    for i in range(3):
        (src / f"small{i}").write_bytes(os.urandom(100 + i))
    prep(src, base / "dest", PrepOptions(partitions=1, codec="zstd", chunk_size=1 << 20,
                                         frame_size=64 << 10, workers=1))
    return base / "dest"


def test_two_short_framed_chunks_of_one_file_are_refused(framed_dest: Path):
    """The manifest that overran a read buffer in the C reader: one file's two chunks of
    600 KiB, framed, summing to the file's size (each within the chunk size)."""
    m = _load(framed_dest)
    b0 = int(m.entries["first"][_idx(m, b"big")])
    assert m.blobs["codec"][b0] == 3 and m.blobs["raw"][b0] == 1 << 20
    for j in (b0, b0 + 1):
        m.blobs["raw"][j] = 600 << 10
        m.blobs["codec"][j] = 3
    with pytest.raises(FormatError, match=f"blob {b0} holds 614400 raw bytes; every blob but a "
                                          "file's last holds the chunk size 1048576"):
        decode_manifest(encode_manifest(m))


def _store_with_table(framed_dest: Path, tmp_path: Path, n_frames: int):
    """A BlobStore over a copy of `framed_dest` whose big file's frame table claims `n_frames`
    frames (the table checksum is not fixed: the bound must come first), and its blob id."""
    from fanstore_fuse._blobstore import BlobStore

    d = tmp_path / "d"
    shutil.copytree(framed_dest, d)
    m = read_manifest(d / MANIFEST_NAME)
    b0 = int(m.entries["first"][_idx(m, b"big")])
    part = d / m.partitions[m.blobs["part"][b0]].name
    with open(part, "r+b") as f:
        f.seek(m.blobs["offset"][b0] + 4)
        f.write(n_frames.to_bytes(4, "little"))
    store = BlobStore(m, str(d))
    reads: list[int] = []
    pread = store._pread

    def counted(blob: int, n: int, off: int) -> bytes:
        reads.append(n)
        return pread(blob, n, off)

    store._pread = counted  # type: ignore[method-assign]
    return store, b0, reads


@pytest.mark.parametrize("claim", ["overrun", "fits-blob-not-raw"])
def test_hostile_frame_count_is_refused_before_the_table_is_read(framed_dest: Path, tmp_path: Path,
                                                                claim: str):
    """A frame table on disk claiming 2^31 frames, or as many as the stored bytes could hold
    (not what the manifest's raw size allows): refused after the 4 KiB probe, before a read
    (and an allocation) of the claimed size."""
    from fanstore_fuse import ChecksumError

    m = read_manifest(framed_dest / MANIFEST_NAME)
    b0 = int(m.entries["first"][_idx(m, b"big")])
    n = (1 << 31) if claim == "overrun" else (int(m.blobs["stored"][b0]) - 8) // 12
    store, blob, reads = _store_with_table(framed_dest, tmp_path, n)
    try:
        with pytest.raises(ChecksumError, match="overruns the blob|does not fit the blob"):
            store.raw(blob)
        assert reads and max(reads) <= 4096, reads
    finally:
        store.close()


def test_peer_bytes_of_the_wrong_length_are_refused_before_decoding(framed_dest: Path,
                                                                   monkeypatch):
    """What a peer sends for a blob must be exactly its manifest stored size before the codec
    sees it (a 600 MB reply for a 3 KB blob is never decoded)."""
    from fanstore_fuse import ChecksumError
    from fanstore_fuse._blobstore import BlobStore

    m = read_manifest(framed_dest / MANIFEST_NAME)
    store = BlobStore(m, str(framed_dest))
    try:
        blob = int(m.entries["first"][_idx(m, b"big")])
        good = store.stored(blob)
        assert store.decode(blob, good) == store.raw(blob)
        monkeypatch.setattr(store.codec, "decode", lambda *a: pytest.fail("decoded"))
        for bad in (good + b"\0", good[:-1], b"", good * 3):
            with pytest.raises(ChecksumError, match="stored bytes, the manifest says"):
                store.decode(blob, bad)
    finally:
        store.close()


# ---------------------------------------------------------------- fuzz: the Python decoders


def _fuzz_manifest(framed_dest: Path) -> bytes:
    return (framed_dest / MANIFEST_NAME).read_bytes()


@pytest.mark.timeout(300)
def test_fuzz_manifest_mutations_never_crash(framed_dest: Path):
    """Random byte flips, splices and truncations of a valid manifest, with the checksums made
    valid again (so the decoder and validator, not the checksums, meet them): only FormatError,
    never another exception, never a hang."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    base = _fuzz_manifest(framed_dest)
    secs, (n, nb) = sections(base), counts(base)
    names = sorted(secs)

    @settings(max_examples=400, deadline=2000, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.sampled_from(names), st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)),
                                            min_size=1, max_size=8),
           st.sampled_from(["flip", "truncate", "extend"]), st.booleans())
    def one(section: str, edits, how: str, rehash: bool) -> None:
        data = bytearray(secs[section])
        if how == "truncate" and data:
            del data[edits[0][0] % len(data):]
        elif how == "extend":
            data += bytes(v for _, v in edits)
        for pos, val in edits:
            if data:
                data[pos % len(data)] = val
        raw = build({**secs, section: bytes(data)}, n, nb)
        if not rehash:  # the raw file with a bad byte: the checksums must catch it
            raw = bytearray(base)
            raw[edits[0][0] % len(raw)] ^= edits[0][1] | 1
            raw = bytes(raw)
        t0 = time.monotonic()
        with contextlib.suppress(FormatError):
            decode_manifest(raw)
        assert time.monotonic() - t0 < 2

    one()


@pytest.mark.timeout(300)
def test_fuzz_stored_frames_never_crash(framed_dest: Path):
    """Random mutations of stored blobs (framed, zstd, raw) and of the sizes the manifest
    claims for them: decoding raises only ChecksumError, never another exception or a hang,
    and never returns bytes other than the blob's."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from fanstore_fuse import ChecksumError
    from fanstore_fuse._blobcodec import BlobCodec
    from fanstore_fuse._blobstore import BlobStore

    m = read_manifest(framed_dest / MANIFEST_NAME)
    store = BlobStore(m, str(framed_dest))
    blobs = [(store.stored(b), int(m.blobs["codec"][b]), int(m.blobs["raw"][b]),
              int(m.blobs["xxh3"][b]), store.raw(b)) for b in range(m.n_blobs)]
    store.close()
    codec = BlobCodec()

    @settings(max_examples=500, deadline=2000, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(st.integers(0, len(blobs) - 1),
           st.lists(st.tuples(st.integers(0, 1 << 22), st.integers(0, 255)), max_size=6),
           st.integers(-64, 64), st.sampled_from([0, 1, 2, 3]), st.integers(-8, 8))
    def one(k: int, edits, cut: int, as_codec: int, raw_delta: int) -> None:
        stored, cod, raw_len, digest, want = blobs[k]
        data = bytearray(stored)
        for pos, val in edits:
            data[pos % len(data)] = val
        if cut < 0:
            del data[cut:]
        else:
            data += bytes(cut)
        c = cod if as_codec == cod or edits else as_codec
        r = max(0, raw_len + raw_delta)
        t0 = time.monotonic()
        try:
            out = codec.decode(bytes(data), c, r, digest, "fuzz")
        except ChecksumError:
            return
        finally:
            assert time.monotonic() - t0 < 2
        assert out == want  # only the blob's own bytes ever come back

    one()


@pytest.mark.timeout(300)
def test_fuzz_manifest_meta_values_never_crash(framed_dest: Path):
    """The `meta` map with any key's value (or an option's, or a partition field) replaced by
    any msgpack value: FormatError or a valid manifest, nothing else."""
    import msgpack
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    base = _fuzz_manifest(framed_dest)
    secs, (n, nb) = sections(base), counts(base)
    meta = msgpack.unpackb(secs["meta"], raw=False)
    leaf = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1),
                     st.floats(allow_nan=True), st.text(max_size=20), st.binary(max_size=20))
    value = st.recursive(leaf, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                      st.dictionaries(st.text(max_size=8), kids,
                                                                      max_size=4)), max_leaves=10)
    paths = ([("format",), ("dataset_id",), ("options",), ("partitions",)]
             + [("options", k) for k in meta["options"]]
             + [("partitions", 0), *[("partitions", 0, j) for j in range(3)]])

    @settings(max_examples=400, deadline=2000, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(st.sampled_from(paths), value)
    def one(path: tuple, v) -> None:
        d = msgpack.unpackb(secs["meta"], raw=False)
        node = d
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = v
        raw = build({**secs, "meta": msgpack.packb(d, use_bin_type=True)}, n, nb)
        with contextlib.suppress(FormatError):
            decode_manifest(raw)

    one()


@pytest.mark.mount
@pytest.mark.timeout(120)
def test_daemon_answers_eio_to_a_hostile_frame_table(framed_dest: Path, tmp_path: Path,
                                                     state_dir: Path):
    """A partition whose frame table claims 2^31 frames: a read of that file gets EIO and the
    daemon logs one line about it, allocates nothing of the claimed size, and keeps serving
    the other files byte for byte."""
    import errno as _errno

    d = tmp_path / "d"
    shutil.copytree(framed_dest, d)
    m = read_manifest(d / MANIFEST_NAME)
    b0 = int(m.entries["first"][_idx(m, b"big")])
    with open(d / m.partitions[m.blobs["part"][b0]].name, "r+b") as f:
        f.seek(m.blobs["offset"][b0] + 4)
        f.write((1 << 31).to_bytes(4, "little"))
    src = framed_dest.parent / "src"
    mp = tmp_path / "mp"
    with mounted(d, mp, state_dir, local=tmp_path / "local") as mnt:
        for i in range(3):
            assert (mp / f"small{i}").read_bytes() == (src / f"small{i}").read_bytes()
        fd = os.open(mp / "big", os.O_RDONLY)
        try:
            with pytest.raises(OSError) as err:
                os.pread(fd, 4096, 0)
            assert err.value.errno == _errno.EIO
        finally:
            os.close(fd)
        # the second chunk is intact and still served
        assert _pread(mp / "big", 1 << 20, 4096) == (src / "big").read_bytes()[1 << 20 : (1 << 20) + 4096]
        assert all(_mountctl_alive(p) for p in mnt.pids())
        lines = [ln for ln in mnt.log_text().splitlines() if f"blob {b0}" in ln]
        assert lines and any("frame table" in ln or "overruns" in ln for ln in lines), \
            mnt.log_text()[-2000:]


def _pread(path: Path, off: int, n: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, n, off)
    finally:
        os.close(fd)


def _mountctl_alive(pid: int) -> bool:
    from fanstore_fuse._mountctl import pid_alive

    return pid_alive(pid)
