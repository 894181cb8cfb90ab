"""READ of dataset files answered in C (`_shim_blobs.c`, `_shim_read.c`, `_fastread.py`):
every blob of a raw, a zstd (framed) and a `--dict auto` tree read by C against the source and
`BlobStore`, corrupt bytes refused; then real mounts (1 and 3 ranks) read through C, compared
byte for byte with the source, with C's counters, `FANSTORE_FASTREAD=0`, a corrupt partition
(EIO and Python's log line) and concurrent readers."""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
from pathlib import Path

import pytest
from _harness import prep_cli

from fanstore_fuse import _fastclose, _fastread
from fanstore_fuse._blobstore import BlobStore
from fanstore_fuse._format import CODEC_FRAMED, MANIFEST_NAME, read_manifest

KiB, MiB = 1 << 10, 1 << 20
CORRUPT = -4  # FANSTORE_BLOB_CORRUPT


def _need_shim():
    if importlib.util.find_spec("fanstore_fuse._noflush") is None or _fastclose._shim is None:
        pytest.fail(f"the _noflush shim is not built or not loaded ({_fastclose._why})")
    return _fastclose._shim


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


# ---------------------------------------------------------------------------- in process


@pytest.mark.parametrize("kind", ["raw", "zstd", "dict"])
def test_every_blob_and_range_read_in_c_matches_blobstore(tmp_path: Path, kind: str):
    shim = _need_shim()
    _, dest, _ = _prep(tmp_path, kind)
    m = read_manifest(dest / MANIFEST_NAME)
    store = BlobStore(m, str(dest))
    codecs = set(m.blobs["codec"])
    assert CODEC_FRAMED in codecs and (kind != "dict" or 2 in codecs), codecs
    rng = random.Random(5)
    try:
        _fastread.hold_blobs(store)
        for b in range(len(m.blobs["part"])):
            raw = store.raw(b)
            assert shim.blob_read(b, 0, len(raw)) == raw, b
            for _ in range(8):
                lo = rng.randrange(len(raw))
                hi = rng.randrange(lo + 1, len(raw) + 1)
                assert shim.blob_read(b, lo, hi) == raw[lo:hi], (b, lo, hi)
    finally:
        shim.drop_blobs()
        store.close()


def test_corrupt_stored_bytes_never_come_back(tmp_path: Path):
    shim = _need_shim()
    _, dest, _ = _prep(tmp_path, "zstd")
    bad = tmp_path / "bad"
    shutil.copytree(dest, bad)
    m = read_manifest(bad / MANIFEST_NAME)
    b = m.blobs
    good = BlobStore(m, str(dest))
    # One whole blob of each codec and one framed blob; flip a byte in the middle of each.
    victims = {}
    for i in range(len(b["part"])):
        victims.setdefault(b["codec"][i], i)
    assert CODEC_FRAMED in victims
    for i in victims.values():
        part = bad / m.partitions[b["part"][i]].name
        with open(part, "r+b") as f:
            pos = b["offset"][i] + b["stored"][i] // 2
            f.seek(pos)
            x = f.read(1)
            f.seek(pos)
            f.write(bytes([x[0] ^ 0x40]))
    store = BlobStore(m, str(bad))
    try:
        _fastread.hold_blobs(store)
        for codec, i in victims.items():
            n = b["raw"][i]
            with pytest.raises(OSError) as ei:
                shim.blob_read(i, 0, n)
            assert ei.value.args[0] == CORRUPT, (codec, ei.value)
        # Frames away from the bad one still read (a framed blob fails only where it is bad).
        fb = victims[CODEC_FRAMED]
        t = good.table(fb)
        k_bad = next(k for k in range(t.count) if t.offsets[k] <= b["stored"][fb] // 2 < t.offsets[k + 1])
        k_ok = 0 if k_bad else t.count - 1
        lo = k_ok * t.frame_size
        assert shim.blob_read(fb, lo, lo + t.raw_size(k_ok)) == good.raw(fb)[lo:lo + t.raw_size(k_ok)]
        # A truncated partition: short reads are errors too, never zeros.
        i = victims[CODEC_FRAMED]
        shim.drop_blobs()
        part = bad / m.partitions[b["part"][i]].name
        os.truncate(part, b["offset"][i] + b["stored"][i] // 2)
        _fastread.hold_blobs(store)
        with pytest.raises(OSError) as ei:
            shim.blob_read(i, 0, b["raw"][i])
        assert ei.value.args[0] == -3, ei.value  # FANSTORE_BLOB_IO
    finally:
        shim.drop_blobs()
        store.close()
        good.close()
