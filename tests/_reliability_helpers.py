"""Shared by the tests/test_reliability_*.py files: deterministic file bytes, a small tree, the
small dataset several of them damage or mount."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

from fanstore_fuse import PrepOptions, prep

WIDE = {"COLUMNS": "400"}  # rich wraps stderr at 80 columns when it is not a terminal (known)


def content(i: int, n: int) -> bytes:
    """Deterministic, partly compressible bytes for file i (readers re-derive it from the name)."""
    seed = hashlib.blake2b(b"%d" % i, digest_size=32).digest()
    return (seed * (n // 32 + 1))[: n // 2] + hashlib.shake_128(seed).digest(n - n // 2)


def small_tree(root: Path, files: int = 40, dirs: int = 4, max_size: int = 9000) -> dict[str, bytes]:
    out = {}
    rng = random.Random(files)
    for i in range(files):
        rel = f"d{i % dirs:02d}/f{i:05d}.bin"
        data = content(i, rng.randint(0, max_size))
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        out[rel] = data
    return out


def small_dataset(base: Path) -> tuple[Path, dict[str, bytes]]:
    """40 small files and one of 4 chunks in 3 partitions (16 KiB chunks): (DEST, rel -> bytes)."""
    files = small_tree(base / "src")
    (base / "src" / "big.bin").write_bytes(content(999, 3 * 4096 * 4 + 77))
    files["big.bin"] = (base / "src" / "big.bin").read_bytes()
    prep(base / "src", base / "dest", PrepOptions(partitions=3, chunk_size=16384, workers=1))
    return base / "dest", files
