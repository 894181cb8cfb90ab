"""prep --dict auto: a zstd dictionary trained on small, similar files (codec 2), stored in the
manifest; smaller output, same bytes read back (in process and mounted), deterministic."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from _harness import mounted

from fanstore_fuse import PrepOptions, prep, verify
from fanstore_fuse._blobstore import BlobStore
from fanstore_fuse._format import CODEC_ZSTD_DICT, MANIFEST_NAME
from fanstore_fuse._manifest import read_manifest
from fanstore_fuse._namespace import Namespace


def _records(src: Path, n: int, seed: int = 1) -> None:
    """n small JSON records that share most of their structure (like annotation files)."""
    rng = random.Random(seed)
    src.mkdir(parents=True)
    for i in range(n):
        rec = {
            "image": {"file_name": f"COCO_train2014_{i:012d}.jpg", "height": rng.randint(200, 640),
                      "width": rng.randint(200, 640), "license": rng.randint(1, 8)},
            "annotations": [{"category_id": rng.randint(1, 90), "iscrowd": 0,
                             "bbox": [round(rng.uniform(0, 600), 2) for _ in range(4)],
                             "area": round(rng.uniform(10, 90000), 3)}
                            for _ in range(rng.randint(1, 6))],
        }  # fmt: skip
        (src / f"ann_{i:05d}.json").write_text(json.dumps(rec, indent=1))


def _files(src: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(src.iterdir())}


def test_dictionary_shrinks_small_similar_files_and_reads_back(tmp_path: Path):
    src = tmp_path / "src"
    _records(src, 300)
    plain = prep(src, tmp_path / "plain", PrepOptions(partitions=2))
    res = prep(src, tmp_path / "dict", PrepOptions(partitions=2, dictionary="auto"))
    m = read_manifest(tmp_path / "dict" / MANIFEST_NAME)
    assert m.zdict and m.options["dict"] == "auto"
    assert sum(1 for c in m.blobs["codec"] if c == CODEC_ZSTD_DICT) > 250
    assert res.stored_bytes < 0.8 * plain.stored_bytes, (res.stored_bytes, plain.stored_bytes)
    assert verify(str(tmp_path / "dict")).ok
    ns, store = Namespace(m), BlobStore(m, str(tmp_path / "dict"))
    try:
        for name, data in _files(src).items():
            got = b"".join(store.raw(b) for b in ns.blobs(ns.resolve(name.encode())))
            assert got == data, name
    finally:
        store.close()


def test_dictionary_prep_is_deterministic_and_declines_large_files(tmp_path: Path):
    src = tmp_path / "src"
    _records(src, 120, seed=2)
    outs = []
    for w in (1, 2, 4):
        d = tmp_path / f"d{w}"
        prep(src, d, PrepOptions(partitions=3, dictionary="auto", workers=w))
        outs.append(_files(d))
    assert outs[0] == outs[1] == outs[2]
    big = tmp_path / "big"
    big.mkdir()
    for i in range(80):  # median over 128 KiB: no dictionary
        (big / f"f{i}").write_bytes(os.urandom(50) * 3000)
    prep(big, tmp_path / "bigdest", PrepOptions(partitions=1, dictionary="auto"))
    assert read_manifest(tmp_path / "bigdest" / MANIFEST_NAME).zdict == b""


@pytest.mark.mount
@pytest.mark.timeout(90)
def test_mounted_dictionary_dataset_reads_every_byte(tmp_path: Path, state_dir: Path):
    src = tmp_path / "src"
    _records(src, 150, seed=3)
    prep(src, tmp_path / "dest", PrepOptions(partitions=2, dictionary="auto"))
    assert read_manifest(tmp_path / "dest" / MANIFEST_NAME).zdict
    with mounted(tmp_path / "dest", tmp_path / "mp", state_dir) as mt:
        assert _files(mt.path) == _files(src)
