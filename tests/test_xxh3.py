"""The C shim's xxh3 dispatched at run time (`_shim_xxh3.c`): every variant this CPU runs gives
the `xxhash` package's value (the format's checksum) for lengths 0..4 MiB, odd sizes and
misaligned buffers; the choice (AVX2 where the CPU has it) and `FANSTORE_XXH3` in a fresh
process; and a real mount read byte for byte with the baseline forced."""

from __future__ import annotations

import os
import platform
import random
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash
from _harness import mounted, prep_cli, status_ranks, status_totals

from fanstore_fuse import _fastclose
from fanstore_fuse._format import HASH_SEED, checksum

KiB, MiB = 1 << 10, 1 << 20


def _shim():
    shim = _fastclose._shim
    if shim is None or not hasattr(shim, "xxh3"):
        pytest.fail(f"the _noflush shim is not built or lacks xxh3 ({_fastclose._why})")
    return shim


def _lengths() -> list[int]:
    """Every length up to 300 (xxh3's short paths end at 240), each side of its stripe (64),
    block (1,024) and the shim's sizes (16 KiB sub-blocks, 128 KiB frames, 1 and 4 MiB), and
    random odd sizes up to 4 MiB."""
    out = set(range(301))
    for edge in (512, 1024, 2048, 4096, 16 * KiB, 64 * KiB, 128 * KiB, 512 * KiB, MiB, 4 * MiB):
        out.update(n for n in (edge - 65, edge - 64, edge - 1, edge, edge + 1, edge + 63) if n <= 4 * MiB)
    rng = random.Random(11)
    out.update(rng.randrange(0, 4 * MiB) | 1 for _ in range(40))
    return sorted(out)


def _cpu_has(flag: str) -> bool:
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("flags") and flag in line.split() for line in f)


def test_every_variant_equals_the_format_checksum():
    shim = _shim()
    variants = shim.xxh3_variants()
    assert variants[0] in ("sse2", "neon", "vsx", "scalar") and shim.xxh3_impl() in variants
    if platform.machine() == "x86_64":
        assert variants[0] == "sse2"
        if _cpu_has("avx2"):  # a GCC build dispatches to AVX2 where the CPU has it
            assert "avx2" in variants and shim.xxh3_impl() == "avx2", variants
    data = random.Random(3).randbytes(4 * MiB + 64)
    view = memoryview(data)
    checked = 0
    for n in _lengths():
        for off in (0, 1, 3, 7, 13, 31, 63) if n <= 64 * KiB or n % 7 == 0 else (0, 5):
            piece = view[off:off + n]
            want = xxhash.xxh3_64_intdigest(piece, seed=HASH_SEED)
            assert checksum(piece) == want
            for v in variants:
                assert shim.xxh3(piece, HASH_SEED, v) == want, (v, n, off)
            assert shim.xxh3(piece, HASH_SEED) == want, (n, off)
            checked += 1
    assert checked > 2_000
    # Other seeds (the dispatch passes the seed through; the format uses HASH_SEED only).
    for seed in (0, 1, 2**64 - 1, 0x9E3779B97F4A7C15):
        for n in (0, 17, 200, 241, 16 * KiB + 3, MiB + 1):
            want = xxhash.xxh3_64_intdigest(view[:n], seed=seed)
            for v in variants:
                assert shim.xxh3(view[:n], seed, v) == want, (v, seed, n)


def test_a_variant_this_cpu_lacks_is_refused():
    shim = _shim()
    with pytest.raises(ValueError, match="not an xxh3 variant"):
        shim.xxh3(b"abc", HASH_SEED, "avx9000")
    with pytest.raises(ValueError, match="block must be"):
        shim.xxh3_cpu_ns(None, b"abc", 0, 1)
    assert shim.xxh3_cpu_ns(None, b"x" * 4096, 1024, 2) >= 0


def _impl_in_fresh_process(value: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "FANSTORE_XXH3"}
    if value is not None:
        env["FANSTORE_XXH3"] = value
    code = ("from fanstore_fuse import _fastclose as f; s = f._shim; "
            "print(s.xxh3_impl(), s.xxh3(b'y' * 5000, 0x46414E53))")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60, check=True)


def test_fanstore_xxh3_forces_a_variant_in_a_fresh_process():
    shim = _shim()
    best = shim.xxh3_variants()[-1]
    want = str(xxhash.xxh3_64_intdigest(b"y" * 5000, seed=HASH_SEED))
    for value, impl in ((None, best), ("auto", best), ("sse2", shim.xxh3_variants()[0]),
                        ("baseline", shim.xxh3_variants()[0]), (best, best)):
        r = _impl_in_fresh_process(value)
        assert r.stdout.split() == [impl, want] and r.stderr == "", (value, r)
    r = _impl_in_fresh_process("avx9000")  # unknown: one line on stderr, then the fastest
    assert r.stdout.split() == [best, want], r
    assert r.stderr.count("\n") == 1 and "FANSTORE_XXH3=avx9000" in r.stderr, r.stderr


@pytest.mark.mount
@pytest.mark.timeout(180)
def test_mount_reads_every_file_with_the_baseline_forced(tmp_path: Path, state_dir: Path):
    """Raw and zstd-framed blobs (sub-blocks, frames, whole blobs) read in C, every byte checked
    by the baseline copy, compared with the source."""
    _shim()
    rng = random.Random(5)
    files = {f"f/{i}.bin": rng.randbytes(n) for i, n in enumerate((0, 1, 4095, 200_000, 3 * MiB + 7))}
    files.update({f"t/{i}.txt": (b"alpha,beta,%d\n" % i) * (n // 12)
                  for i, n in enumerate((5_000, 300_000, 2 * MiB))})
    src = tmp_path / "src"
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    dest = prep_cli(src, tmp_path / "dest", "-p", "2", "--chunk-mib", "1", "--frame-kib", "64")
    with mounted(dest, tmp_path / "mnt", state_dir, local=tmp_path / "local",
                 env={"FANSTORE_XXH3": "sse2"}) as m:
        for rel, data in files.items():
            assert (m.path / rel).read_bytes() == data, rel
            with open(m.path / rel, "rb") as f:  # part of a frame, then across frames
                f.seek(len(data) // 3)
                assert f.read(70_000) == data[len(data) // 3:len(data) // 3 + 70_000], rel
        (c,) = [r["fuse_shim"] for r in status_ranks(m.status())]
        st = status_totals(m.status())
    assert c["c_reads"] >= len(files) and c["c_read_fallbacks"] == 0, c
    assert st["errors"] == 0, st
