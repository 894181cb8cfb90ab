"""Deterministic benchmark datasets under bench/data/<mode>/src.

Three trees, all inside one source directory so every system is prepped/mounted once:

* ``imagenet/train/nXXXXXXXX/*.JPEG`` — ImageNet-like: ~110 KiB incompressible "JPEG" files
  (JFIF header, random body, EOI marker) in ~100 class directories;
* ``npy/*.npy`` — compressible float32 arrays (8-bit pixel values stored as float, like a
  preprocessed tensor cache) plus a few CSV label files;
* ``large/*.bin`` — a few large incompressible files.

A stamp file records the parameters; a tree with a matching stamp is reused as it is.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ._util import REPO, log, rm_rf

DATA_ROOT = REPO / "bench" / "data"
GEN_VERSION = 2
MiB = 1 << 20
KiB = 1 << 10


@dataclass(frozen=True)
class Params:
    mode: str
    n_small: int
    n_classes: int
    small_mean: int  # bytes
    n_npy: int
    npy_shape: tuple[int, int, int]
    n_large: int
    large_size: int
    seed: int = 20180928  # FanStore's arXiv date
    version: int = GEN_VERSION


QUICK = Params(
    mode="quick",
    n_small=5000,
    n_classes=100,
    small_mean=110 * KiB,
    n_npy=400,
    npy_shape=(3, 96, 96),
    n_large=4,
    large_size=64 * MiB,
)
FULL = Params(
    mode="full",
    n_small=20000,
    n_classes=100,
    small_mean=110 * KiB,
    n_npy=2000,
    npy_shape=(3, 128, 128),
    n_large=4,
    large_size=256 * MiB,
)
TINY = Params(  # for developing the harness
    mode="tiny",
    n_small=400,
    n_classes=10,
    small_mean=110 * KiB,
    n_npy=40,
    npy_shape=(3, 64, 64),
    n_large=2,
    large_size=16 * MiB,
)
PRESETS = {"quick": QUICK, "full": FULL, "tiny": TINY}


@dataclass
class Dataset:
    params: Params
    root: Path  # bench/data/<mode>
    src: Path  # root/src: the tree every system serves
    small: list[tuple[str, int]]  # (relative path, size)
    npy: list[tuple[str, int]]
    large: list[tuple[str, int]]
    gen_seconds: float
    reused: bool

    @property
    def all_files(self) -> list[tuple[str, int]]:
        return self.small + self.npy + self.large

    def total_bytes(self, which: str | None = None) -> int:
        files = self.all_files if which is None else getattr(self, which)
        return sum(s for _, s in files)


_JFIF = bytes.fromhex("ffd8ffe000104a46494600010101004800480000")
_EOI = bytes.fromhex("ffd9")


def _small_sizes(p: Params) -> np.ndarray:
    rng = np.random.default_rng([p.seed, 1])
    # ImageNet train JPEGs: mean ~110 KiB, wide spread; a clipped lognormal keeps the mean.
    s = rng.lognormal(mean=0.0, sigma=0.35, size=p.n_small)
    s = s / s.mean() * p.small_mean
    return np.clip(s, 8 * KiB, 8 * p.small_mean).astype(np.int64)


def _class_names(p: Params) -> list[str]:
    rng = np.random.default_rng([p.seed, 2])
    ids = rng.choice(np.arange(1_000_000, 16_000_000), size=p.n_classes, replace=False)
    return [f"n{int(i):08d}" for i in sorted(ids)]


def _write(path: Path, data: bytes | memoryview) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _generate(p: Params, src: Path) -> None:
    sizes = _small_sizes(p)
    classes = _class_names(p)
    train = src / "imagenet" / "train"
    for c in classes:
        (train / c).mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([p.seed, 3])
    # generate the random bodies in ~64 MiB batches (fast, deterministic)
    i = 0
    while i < p.n_small:
        j = i
        batch = 0
        while j < p.n_small and batch < 64 * MiB:
            batch += int(sizes[j])
            j += 1
        blob = memoryview(rng.bytes(batch))
        off = 0
        for k in range(i, j):
            n = int(sizes[k])
            c = classes[k % p.n_classes]
            body = blob[off : off + n - len(_JFIF) - len(_EOI)]
            off += n
            _write(train / c / f"{c}_{k:06d}.JPEG", _JFIF + body.tobytes() + _EOI)
        i = j

    npy = src / "npy"
    npy.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([p.seed, 4])
    c, h, w = p.npy_shape
    yy, xx = np.mgrid[0:h, 0:w]
    for k in range(p.n_npy):
        # a smooth 8-bit "image" with a little noise, stored as float32 (compresses ~3-5x)
        fx, fy, ph = rng.uniform(0.02, 0.2, size=3)
        base = 127.5 + 100 * np.sin(fx * xx + ph) * np.cos(fy * yy)
        arr = np.empty((c, h, w), dtype=np.float32)
        for ch in range(c):
            noise = rng.integers(-3, 4, size=(h, w))
            arr[ch] = np.clip(np.round(base + 20 * ch + noise), 0, 255)
        np.save(npy / f"sample_{k:06d}.npy", arr)
    labels = rng.integers(0, 1000, size=p.n_npy)
    with open(npy / "labels.csv", "w") as f:
        f.write("file,label,split\n")
        for k in range(p.n_npy):
            f.write(f"sample_{k:06d}.npy,{int(labels[k])},train\n")

    large = src / "large"
    large.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([p.seed, 5])
    for k in range(p.n_large):
        with open(large / f"shard_{k:02d}.bin", "wb") as f:
            left = p.large_size
            while left:
                n = min(left, 32 * MiB)
                f.write(rng.bytes(n))
                left -= n


def _manifest(src: Path) -> dict[str, list[tuple[str, int]]]:
    out: dict[str, list[tuple[str, int]]] = {"small": [], "npy": [], "large": []}
    key = {"imagenet": "small", "npy": "npy", "large": "large"}
    for root, dirs, files in os.walk(src):
        dirs.sort()
        for f in sorted(files):
            full = os.path.join(root, f)
            rel = os.path.relpath(full, src)
            out[key[rel.split(os.sep, 1)[0]]].append((rel, os.path.getsize(full)))
    return out


def ensure(p: Params, root: Path | None = None) -> Dataset:
    """Generate (or reuse) the dataset for these parameters."""
    root = root or DATA_ROOT / p.mode
    src = root / "src"
    stamp = root / "stamp.json"
    want = asdict(p)
    want["npy_shape"] = list(p.npy_shape)
    if stamp.exists():
        try:
            have = json.loads(stamp.read_text())
        except ValueError:
            have = {}
        if have.get("params") == want and src.is_dir():
            m = have["manifest"]
            log(f"dataset '{p.mode}': reusing {root} (stamp matches)")
            return Dataset(
                p,
                root,
                src,
                [tuple(x) for x in m["small"]],
                [tuple(x) for x in m["npy"]],
                [tuple(x) for x in m["large"]],
                float(have.get("gen_seconds", 0.0)),
                True,
            )
    log(
        f"dataset '{p.mode}': generating {p.n_small} small files (~{p.small_mean // KiB} KiB, "
        f"{p.n_classes} classes), {p.n_npy} .npy arrays, {p.n_large} x "
        f"{p.large_size // MiB} MiB large files under {src}"
    )
    stamp.unlink(missing_ok=True)
    rm_rf(src)
    src.mkdir(parents=True)
    t0 = time.perf_counter()
    _generate(p, src)
    os.sync()
    dt = time.perf_counter() - t0
    m = _manifest(src)
    stamp.write_text(json.dumps({"params": want, "gen_seconds": dt, "manifest": m}))
    log(f"dataset '{p.mode}': generated in {dt:.1f}s")
    return Dataset(p, root, src, m["small"], m["npy"], m["large"], dt, False)
