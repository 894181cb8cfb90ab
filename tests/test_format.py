"""The on-disk format without FUSE: manifest round trips (hypothesis), corruption, versions,
truncation, hostile manifests, and blob verification (see docs/format.md)."""

from __future__ import annotations

import os
import re
import stat
import struct
import tempfile
from array import array
from pathlib import Path

import pytest
from _manifests import build, counts, rehead, sections
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fanstore_fuse import ChecksumError, FormatError, Namespace, PrepOptions, prep, verify
from fanstore_fuse._blobcodec import BlobCodec
from fanstore_fuse._blobstore import BlobStore
from fanstore_fuse._format import (
    CODEC_RAW,
    CODEC_ZSTD,
    FORMAT_VERSION,
    HASH_SEED,
    KIND_DIR,
    KIND_FILE,
    KIND_LINK,
    MANIFEST_MAGIC,
    MANIFEST_NAME,
    PARTITION_DATA_START,
    SECTIONS,
    checksum,
    partition_header,
)
from fanstore_fuse._manifest import (
    _MANIFEST_HEADER,
    _SECTION,
    decode_manifest,
    encode_manifest,
    read_manifest,
)

SMALL_CHUNK = 4096


# ---------------------------------------------------------------------------- helpers


def file_bytes(m, store: BlobStore, ns: Namespace, i: int) -> bytes:
    return b"".join(store.raw(b) for b in ns.blobs(i))


def assert_manifest_matches_tree(src: Path, dest: Path, chunk: int) -> int:
    """Every entry of the manifest equals the source (lstat + bytes), and vice versa."""
    m = read_manifest(dest / MANIFEST_NAME)
    ns = Namespace(m)
    store = BlobStore(m, str(dest))
    srcb = os.fsencode(src)
    seen = set()
    try:
        for i in range(len(ns)):
            rel = ns.path(i)
            seen.add(rel)
            full = os.path.join(srcb, rel) if rel else srcb
            st_ = os.lstat(full)
            r = ns.record(i)
            assert r.mode == st_.st_mode & ~(stat.S_ISUID | stat.S_ISGID), rel
            assert (r.uid, r.gid, r.mtime_ns) == (st_.st_uid, st_.st_gid, st_.st_mtime_ns), rel
            if stat.S_ISDIR(st_.st_mode):
                assert r.kind == KIND_DIR
                assert r.size == st_.st_size
                kids = sorted(os.listdir(full))
                kids = [k for k in kids if _kept(os.path.join(full, k))]
                assert [ns.name(j) for j in ns.children(i)] == kids, rel
            elif stat.S_ISLNK(st_.st_mode):
                assert r.kind == KIND_LINK
                assert ns.readlink(i) == os.readlink(full)
                assert r.size == len(os.readlink(full))
            else:
                assert r.kind == KIND_FILE
                data = open(full, "rb").read()
                assert r.size == len(data)
                assert r.count == -(-len(data) // chunk)
                assert file_bytes(m, store, ns, i) == data, rel
                for b in ns.blobs(i):
                    assert m.blobs["raw"][b] <= chunk
                    assert m.blobs["xxh3"][b] == checksum(store.raw(b))
    finally:
        store.close()
    expected = set()
    for dp, dns, fns in os.walk(srcb):
        for n in dns + fns:
            p = os.path.join(dp, n)
            if _kept(p):
                expected.add(os.path.relpath(p, srcb))
    assert seen == expected | {b""}
    return len(seen)


def _kept(p: bytes) -> bool:
    md = os.lstat(p).st_mode
    return stat.S_ISDIR(md) or stat.S_ISREG(md) or stat.S_ISLNK(md)


# Trees as nested dicts: name -> bytes (file) | ("link", target) | dict (directory).
names = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="/\0"),
             min_size=1, max_size=12).map(lambda s: s.encode()),
    st.binary(min_size=1, max_size=8),
).filter(lambda b: b not in (b".", b"..") and b"/" not in b and b"\0" not in b and len(b) <= 255)
contents = st.one_of(
    st.binary(max_size=3 * SMALL_CHUNK + 7),
    st.builds(lambda s, k: s * k, st.binary(min_size=1, max_size=16), st.integers(1, 2000)),
)
leaves = st.one_of(contents, st.tuples(st.just("link"), st.binary(min_size=1, max_size=40).filter(
    lambda b: b"\0" not in b)))
trees = st.recursive(
    st.dictionaries(names, leaves, max_size=6),
    lambda children: st.dictionaries(names, st.one_of(leaves, children), max_size=5),
    max_leaves=25,
)


def materialize(root: bytes, tree: dict, mtime: list[int]) -> None:
    os.makedirs(root, exist_ok=True)
    for name, v in tree.items():
        p = os.path.join(root, name)
        if isinstance(v, dict):
            materialize(p, v, mtime)
        elif isinstance(v, tuple):
            os.symlink(v[1], p)
        else:
            with open(p, "wb") as f:
                f.write(v)
            os.chmod(p, 0o600 | (len(v) % 8) << 3 | 0o4000 * (len(v) % 3 == 0))
        mtime[0] += 1_234_567
        os.utime(p, ns=(mtime[0], mtime[0]), follow_symlinks=False)
    os.utime(root, ns=(mtime[0] - 99, mtime[0] - 99))


# ---------------------------------------------------------------------------- round trips


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=trees, parts=st.integers(1, 4), codec=st.sampled_from(["zstd", "none"]),
       chunk=st.sampled_from([SMALL_CHUNK, 8192]))
def test_manifest_round_trip(tree, parts, codec, chunk):
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(os.fsencode(tmp), b"src")
        materialize(src, tree, [1_500_000_000_000_000_001])
        dest = Path(tmp) / "dest"
        res = prep(os.fsdecode(src), dest, PrepOptions(partitions=parts, codec=codec,
                                                       chunk_size=chunk, workers=2))
        n = assert_manifest_matches_tree(Path(os.fsdecode(src)), dest, chunk)
        assert n == res.manifest.n_entries
        assert verify(str(dest)).ok
        # The manifest also survives a second encode/decode unchanged.
        again = decode_manifest(encode_manifest(res.manifest))
        assert encode_manifest(again) == (dest / MANIFEST_NAME).read_bytes()
        m2 = read_manifest(dest / MANIFEST_NAME)
        assert m2.entries == again.entries and m2.blobs == again.blobs
        assert bytes(m2.names) == bytes(res.manifest.names)


@pytest.fixture
def small_dest(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "d" / "e").mkdir(parents=True)
    (src / "a.txt").write_bytes(b"hello " * 1000)  # compressible -> zstd
    (src / "d" / "r.bin").write_bytes(os.urandom(3 * SMALL_CHUNK + 100))  # random -> raw, 4 blobs
    (src / "d" / "e" / "z").write_bytes(b"")
    os.symlink("d/r.bin", src / "link")
    prep(src, tmp_path / "dest", PrepOptions(partitions=2, chunk_size=SMALL_CHUNK, workers=1))
    return tmp_path / "dest"


def _manifest_bytes(dest: Path) -> bytes:
    return (dest / MANIFEST_NAME).read_bytes()


# ---------------------------------------------------------------------------- corruption


def test_every_header_bit_flip_is_refused(small_dest: Path):
    data = _manifest_bytes(small_dest)
    decode_manifest(data)
    for byte in range(_MANIFEST_HEADER.size + _SECTION.size * len(SECTIONS)):
        for bit in range(8):
            bad = bytearray(data)
            bad[byte] ^= 1 << bit
            with pytest.raises(FormatError):
                decode_manifest(bytes(bad))


def test_payload_bit_flips_are_refused(small_dest: Path):
    data = _manifest_bytes(small_dest)
    hs = _MANIFEST_HEADER.size
    for pos in range(hs + _SECTION.size * len(SECTIONS), len(data), max(1, (len(data) - hs) // 97)):
        for bit in (0, 3, 7):
            bad = bytearray(data)
            bad[pos] ^= 1 << bit
            with pytest.raises(FormatError, match="checksum"):
                decode_manifest(bytes(bad))


def test_truncated_manifest(small_dest: Path, tmp_path: Path):
    data = _manifest_bytes(small_dest)
    for n in (0, 1, 8, _MANIFEST_HEADER.size - 1, _MANIFEST_HEADER.size, len(data) // 2, len(data) - 1):
        with pytest.raises(FormatError):
            decode_manifest(data[:n])
    with pytest.raises(FormatError, match="header says"):
        decode_manifest(data + b"x")
    with pytest.raises(FormatError, match="no manifest"):
        read_manifest(tmp_path / "nope" / MANIFEST_NAME)
    with pytest.raises(FormatError, match="directory"):
        read_manifest(tmp_path)


def test_version_mismatch(small_dest: Path):
    data = _manifest_bytes(small_dest)
    assert decode_manifest(rehead(data)).n_entries == 7
    for v in (0, 1, FORMAT_VERSION + 1, 0xFFFF):
        with pytest.raises(FormatError, match="version"):
            decode_manifest(rehead(data, version=v))
    with pytest.raises(FormatError, match="re-run `fanstore-fuse prep`"):
        decode_manifest(rehead(data, version=1))
    with pytest.raises(FormatError, match="flags"):
        decode_manifest(rehead(data, flags=1))
    with pytest.raises(FormatError, match="sections"):
        decode_manifest(rehead(data, sections=3))
    # A meta section claiming another format version, or not msgpack at all, checksums valid.
    import msgpack

    secs = sections(data)
    n, nb = counts(data)
    meta = msgpack.unpackb(secs["meta"], raw=False)
    for bad, msg in (({**meta, "format": FORMAT_VERSION + 1}, "format"), ([1, 2, 3], "format"),
                     ({**meta, "partitions": [["x"]]}, "malformed"), ({**meta, "dataset_id": "x"},
                                                                         "malformed")):
        with pytest.raises(FormatError, match=msg):
            decode_manifest(build({**secs, "meta": msgpack.packb(bad, use_bin_type=True)}, n, nb))
    with pytest.raises(FormatError, match="msgpack"):
        decode_manifest(build({**secs, "meta": b"\xc1\xc1\xc1"}, n, nb))
    with pytest.raises(FormatError, match="magic"):
        decode_manifest(b"FSTRPART" + data[8:])


def test_version_1_manifest_is_refused_with_a_hint(tmp_path: Path):
    """A manifest written by the version-1 prep (32-byte header, zstd msgpack payload)."""
    import zstandard

    payload = zstandard.ZstdCompressor().compress(b"\x80")
    v1 = struct.pack("<8sHHIQQ", MANIFEST_MAGIC, 1, 1, 0, len(payload), checksum(payload)) + payload
    (tmp_path / MANIFEST_NAME).write_bytes(v1)
    with pytest.raises(FormatError, match="version 1.*re-run `fanstore-fuse prep`"):
        read_manifest(tmp_path / MANIFEST_NAME)


def test_sizes_and_counts_are_checked_before_anything_is_read(small_dest: Path):
    data = _manifest_bytes(small_dest)
    n, nb = counts(data)
    for fields, msg in (
        (dict(entries=2**40), "out of range"), (dict(entries=0), "out of range"),
        (dict(blobs=2**41), "out of range"), (dict(entries=2**31), "expected"),
        (dict(blobs=2**30), "expected"), (dict(entries=n + 1), "expected"),
        (dict(size=len(data) + (4 << 30)), "header says"),
    ):
        with pytest.raises(FormatError, match=msg):
            decode_manifest(rehead(data, **fields))
    secs = sections(data)
    with pytest.raises(FormatError, match="names"):  # a name heap longer than 255 per entry
        decode_manifest(build({**secs, "names": bytes(256 * n)}, n, nb))


def _hostile(dest: Path, mutate) -> bytes:
    m = read_manifest(dest / MANIFEST_NAME, writable=True)
    mutate(m)
    return encode_manifest(m)


HOSTILE = [
        (lambda m: m.entries["parent"].__setitem__(1, 5), "parent"),
        (lambda m: m.entries["mode"].__setitem__(1, m.entries["mode"][1] | stat.S_ISUID), "setuid"),
        (lambda m: m.entries["kind"].__setitem__(0, KIND_FILE), "root"),
        (lambda m: m.entries["kind"].__setitem__(1, 7), "kind"),
        (lambda m: m.entries["size"].__setitem__(_first_file(m), 1), "size"),
        (lambda m: m.entries["count"].__setitem__(0, 1), "cover|parent"),
        (lambda m: m.entries["first"].__setitem__(0, 0), "children|cycle|parent"),
        (lambda m: setattr(m, "names", bytes(m.names).replace(b"a.txt", b"../xx")), "unsafe"),
        (lambda m: setattr(m, "names", bytes(m.names).replace(b"a.txt", b"a/txt")), "unsafe"),
        (lambda m: setattr(m.partitions[0], "name", "../evil"), "unsafe"),
        (lambda m: setattr(m.partitions[1], "name", m.partitions[0].name), "duplicate"),
        (lambda m: setattr(m.partitions[0], "size", 10), "too small"),
        (lambda m: m.blobs["offset"].__setitem__(0, 10**12), "outside"),
        (lambda m: m.blobs["offset"].__setitem__(0, 3), "outside"),
        (lambda m: m.blobs["part"].__setitem__(0, 99), "partition"),
        (lambda m: m.blobs["codec"].__setitem__(0, 9), "codec"),
        (lambda m: m.blobs["codec"].__setitem__(0, 2), "dictionary"),
        (lambda m: m.options.__setitem__("chunk_size", 1 << 40), "chunk"),
        (lambda m: m.name_off.__setitem__(len(m.name_off) - 1, 1), "name table"),
        # r.bin's first blob (raw) cut short: only a file's last blob may hold less than a chunk
        (lambda m: [m.blobs[c].__setitem__(_first_blob(m, b"d/r.bin"), 100)
                    for c in ("raw", "stored")], "every blob but a file's last"),
        (lambda m: m.blobs["raw"].__setitem__(_first_blob(m, b"d/r.bin") + 3, 0), "empty"),
]


def _first_blob(m, path: bytes) -> int:
    return int(m.entries["first"][next(i for i in range(m.n_entries) if m.path(i) == path)])


@pytest.mark.parametrize("mutate, msg", HOSTILE)
def test_hostile_manifests_are_refused(small_dest: Path, mutate, msg):
    with pytest.raises(FormatError, match=msg):
        decode_manifest(_hostile(small_dest, mutate))


def _split_errors(data: bytes, parts: int) -> list[str]:
    """Validate `data` in `parts` shares, as the ranks of a mount do; every share's error."""
    from fanstore_fuse import _manifest, _validate

    try:
        m = _manifest._parse(memoryview(data), None, validate=False)
    except FormatError as e:  # header, checksums, partition table: every rank checks those
        return [str(e)]
    errors, children = [], 0
    for part in range(parts):
        try:
            children += _validate.validate(m, part, parts)
        except FormatError as e:
            errors.append(str(e))
    if not errors:
        try:
            _validate.check_children(children, m.n_entries)
        except FormatError as e:
            errors.append(str(e))
    return errors


@pytest.mark.parametrize("mutate, msg", [(lambda m: None, ""), *HOSTILE])
def test_validation_split_between_ranks_finds_what_one_finds(small_dest: Path, mutate, msg,
                                                              monkeypatch):
    """Each rank of a mount validates one share of every loop (chunks of 4 items here, so the
    small tree has many): a valid manifest passes in every split, and a hostile one is refused
    by some share with the error one whole validation gives."""
    from fanstore_fuse import _validate

    monkeypatch.setattr(_validate, "CHUNK", 4)
    data = _hostile(small_dest, mutate)
    for parts in (1, 2, 3, 7):
        errors = _split_errors(data, parts)
        if not msg:
            assert errors == [], (parts, errors)
        else:
            assert errors and any(re.search(msg, e) for e in errors), (parts, errors)


def _first_file(m) -> int:
    return next(i for i in range(m.n_entries) if m.entries["kind"][i] == KIND_FILE)


def test_column_length_mismatch_is_refused(small_dest: Path):
    def drop(m):
        m.entries["uid"] = array("I", list(m.entries["uid"])[:-1])

    with pytest.raises(FormatError, match="uid"):
        decode_manifest(_hostile(small_dest, drop))


def _blob_of(dest: Path, rel: bytes, k: int = 0):
    m = read_manifest(dest / MANIFEST_NAME)
    ns = Namespace(m)
    b = ns.blobs(ns.resolve(rel))[k]
    return m, b


def _flip(path: Path, offset: int, mask: int = 0x01) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        c = f.read(1)
        f.seek(offset)
        f.write(bytes([c[0] ^ mask]))


@pytest.mark.parametrize("rel, codec", [(b"a.txt", CODEC_ZSTD), (b"d/r.bin", CODEC_RAW)])
def test_partition_bit_flip_detected(small_dest: Path, rel: bytes, codec: int):
    m, b = _blob_of(small_dest, rel, k=1 if rel == b"d/r.bin" else 0)
    assert m.blobs["codec"][b] == codec
    part = m.partitions[m.blobs["part"][b]].name
    stored = m.blobs["stored"][b]
    for pos in (0, stored // 2, stored - 1):
        _flip(small_dest / part, m.blobs["offset"][b] + pos)
        store = BlobStore(m, str(small_dest))
        with pytest.raises(ChecksumError) as ei:
            store.raw(b)
        assert part in str(ei.value) and f"blob {b}" in str(ei.value)
        store.close()
        rep = verify(str(small_dest), workers=1)
        assert not rep.ok and len(rep.problems) == 1
        assert rel.decode() in rep.problems[0] and part in rep.problems[0]
        _flip(small_dest / part, m.blobs["offset"][b] + pos)  # restore
        assert verify(str(small_dest)).ok


def test_truncated_and_missing_partition(small_dest: Path):
    m, b = _blob_of(small_dest, b"d/r.bin", k=3)
    part = small_dest / m.partitions[m.blobs["part"][b]].name
    data = part.read_bytes()
    part.write_bytes(data[: m.blobs["offset"][b] + 10])
    store = BlobStore(m, str(small_dest))
    with pytest.raises(ChecksumError, match="truncated"):
        store.raw(b)
    store.close()
    rep = verify(str(small_dest))
    assert any("bytes, manifest says" in p for p in rep.problems)
    assert any("d/r.bin" in p and "truncated" in p for p in rep.problems)
    part.unlink()
    rep = verify(str(small_dest))
    assert any("missing" in p for p in rep.problems)
    store = BlobStore(m, str(small_dest))
    with pytest.raises(ChecksumError, match="unreadable"):
        store.raw(b)
    store.close()


def test_partition_header_checks(small_dest: Path):
    m = read_manifest(small_dest / MANIFEST_NAME)
    p0 = small_dest / m.partitions[0].name
    data = p0.read_bytes()
    assert data[:PARTITION_DATA_START] == partition_header(0, m.dataset_id, False)
    # Another dataset's partition in slot 0.
    p0.write_bytes(partition_header(0, m.dataset_id ^ 1, False) + data[PARTITION_DATA_START:])
    assert any("another dataset" in p for p in verify(str(small_dest)).problems)
    p0.write_bytes(b"XXXXXXXX" + data[8:])
    assert any("bad magic" in p for p in verify(str(small_dest)).problems)
    hdr = bytearray(data[:PARTITION_DATA_START])
    struct.pack_into("<H", hdr, 8, FORMAT_VERSION + 1)
    p0.write_bytes(bytes(hdr) + data[PARTITION_DATA_START:])
    assert any("version" in p for p in verify(str(small_dest)).problems)
    p0.write_bytes(data)
    assert verify(str(small_dest)).ok


def test_blob_codec_refuses_wrong_bytes():
    codec = BlobCodec()
    raw = b"abc" * 1000
    import zstandard

    z = zstandard.ZstdCompressor().compress(raw)
    assert codec.decode(z, CODEC_ZSTD, len(raw), checksum(raw), "t") == raw
    assert codec.decode(raw, CODEC_RAW, len(raw), checksum(raw), "t") == raw
    with pytest.raises(ChecksumError, match="checksum"):
        codec.decode(raw, CODEC_RAW, len(raw), checksum(raw) ^ 1, "t")
    with pytest.raises(ChecksumError, match="expected"):
        codec.decode(raw[:-1], CODEC_RAW, len(raw), checksum(raw), "t")
    with pytest.raises(ChecksumError):
        codec.decode(z[:-3], CODEC_ZSTD, len(raw), checksum(raw), "t")
    with pytest.raises(ChecksumError):  # decodes to more than the recorded raw length
        codec.decode(z, CODEC_ZSTD, len(raw) - 1, checksum(raw), "t")


def test_checksum_is_seeded_xxh3():
    import xxhash

    assert HASH_SEED == 0x46414E53
    assert checksum(b"fanstore") == xxhash.xxh3_64_intdigest(b"fanstore", seed=HASH_SEED)
    assert checksum(b"fanstore") != xxhash.xxh3_64_intdigest(b"fanstore")


def test_read_columns_checks_the_sections_it_returns(tmp_path: Path):
    """`_columns.read_columns` (the access warning's cheap look): the columns equal the full
    reader's; a flipped byte in a returned section is refused, one elsewhere is not its
    business (the mount's full read refuses it)."""
    from fanstore_fuse._columns import read_columns
    from fanstore_fuse._format import SECTIONS
    from fanstore_fuse._manifest import _MANIFEST_HEADER, _SECTION, read_manifest

    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    for i in range(30):
        (src / "d" / f"f{i}").write_bytes(b"z" * i)
    res = prep(src, tmp_path / "dest", PrepOptions(partitions=2))
    path = tmp_path / "dest" / "manifest.fsm"
    full = read_manifest(path)
    parts, cols = read_columns(path, ("kind", "mode", "gid"))
    assert [p.name for p in parts] == [p.name for p in full.partitions]
    for k in ("kind", "mode", "gid"):
        assert list(cols[k]) == list(full.entries[k])
    data = bytearray(path.read_bytes())
    where = {name: _SECTION.unpack_from(data, _MANIFEST_HEADER.size + k * _SECTION.size)
             for k, name in enumerate(SECTIONS)}
    for name, refused in (("entries.mode", True), ("names", False)):
        bad = bytearray(data)
        bad[where[name][0] + 1] ^= 0x40
        p = tmp_path / f"bad-{name}.fsm"
        p.write_bytes(bad)
        if refused:
            with pytest.raises(FormatError, match="entries.mode"):
                read_columns(p, ("kind", "mode", "gid"))
        else:
            read_columns(p, ("kind", "mode", "gid"))
        with pytest.raises(FormatError, match="checksum mismatch"):
            read_manifest(p)
    assert res.manifest.n_entries == full.n_entries
