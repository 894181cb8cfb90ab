"""Python's fetches through the C remote thread (`_shim_remote_py.c`: `remote_fetch`,
`remote_take`, the bytes laid where the reply was received) between two real `mpiexec` ranks,
without FUSE: large and small blobs of every codec byte for byte, damaged blobs never returned,
a silent peer's time-out an errno."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _harness import C_REMOTE_MARKS, prep_cli

from fanstore_fuse._format import MANIFEST_NAME
from fanstore_fuse._manifest import read_manifest
from fanstore_fuse._ring import Placement

pytestmark = C_REMOTE_MARKS
HERE = Path(__file__).parent
KiB, MiB = 1 << 10, 1 << 20


def _tree(root: Path) -> Path:
    """Incompressible large files (4 MiB chunks of raw 16 KiB frames; a last chunk of an odd
    number of frames), compressible ones (zstd frames), and small files."""
    root.mkdir()
    rnd = os.urandom
    (root / "random.bin").write_bytes(rnd(12 * MiB + MiB + 2 * 16 * KiB + 100))
    (root / "text.txt").write_bytes(b"".join(b"row %08d, a line of a long text file\n" % k
                                             for k in range(260_000)))
    (root / "empty").write_bytes(b"")
    for i in range(12):
        (root / f"small_{i}.bin").write_bytes(rnd(1000 + 7919 * i) if i % 2 else b"abc" * (3000 + i))
    return root


def _run(dest: Path, served: Path, rounds: int, out: Path) -> list[dict]:
    out.mkdir()
    mpiexec = Path(sys.executable).parent / "mpiexec"
    p = subprocess.run([str(mpiexec), "-n", "2", sys.executable, str(HERE / "_cremote_fetch_ranks.py"),
                        str(dest), str(served), str(rounds), str(out)], capture_output=True, text=True,
                       timeout=200)
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("frames", ["128", "0"])
def test_python_fetches_large_blobs_byte_for_byte(tmp_path, frames):
    """frames=128: framed chunks (raw sub-blocks and zstd frames); 0: whole raw and zstd blobs."""
    dest = prep_cli(_tree(tmp_path / "src"), tmp_path / "dest", "-p", "3", "--frame-kib", frames)
    client, _ = _run(dest, dest, 4, tmp_path / "out")
    assert client["large"] >= 2, client
    assert {0, 1} <= set(client["codecs"]) and (3 in client["codecs"]) == (frames == "128")
    assert client["mismatched"] == []
    assert client["kinds"] == ["RemoteBytes"]  # every blob came through the C thread
    assert set(client["c_status"].values()) == {0}
    assert client["cancelled"] == len(client["c_status"]) and client["after_cancel"] == []
    assert client["stats"]["c_remote_reads"] == client["fetched"] + len(client["c_status"])
    c = client["c"]
    assert c["corrupt"] == 0 and c["fetched"] >= client["fetched"]
    # raw blobs and blobs of raw frames stay where they were received (no copy); the blobs
    # with zstd bytes, and those whose buffer has no room, are decoded or copied
    assert 0 < c["py_in_place"] < c["fetched"], c
    # every object is freed with the buffer it lies in: rounds 2 to 4 moved 3 x the large
    # blobs (> 45 MiB) without growing the process
    assert client["rss_growth"] < 24 * MiB, client["rss_growth"]
    # rank 1's C thread stopped: the call ends with ETIMEDOUT after its 0.5 s (deadlines are
    # checked every 0.2 s), and the blob source gets the bytes through Python's transport
    assert client["timeout_status"] == -errno.ETIMEDOUT
    assert 0.4 < client["timeout_s"] < 3.0
    assert client["after_timeout_ok"]


def _damage(dest: Path, served: Path) -> list[int]:
    """A copy of DEST whose blobs only rank 1 holds have one byte flipped in their middle."""
    shutil.copytree(dest, served)
    m = read_manifest(served / MANIFEST_NAME)
    pl = Placement(2, 1)
    hit = []
    for b in range(m.n_blobs):
        stored = int(m.blobs["stored"][b])
        if stored and pl.holds(1, b) and not pl.holds(0, b):
            with open(served / m.partitions[int(m.blobs["part"][b])].name, "r+b") as f:
                off = int(m.blobs["offset"][b]) + stored // 2
                f.seek(off)
                byte = f.read(1)
                f.seek(off)
                f.write(bytes([byte[0] ^ 0x5A]))
            hit.append(b)
    return hit


@pytest.mark.timeout(300)
def test_damaged_blobs_never_reach_python(tmp_path):
    """Rank 1 serves damaged copies: the C thread answers an errno for every one, and the blob
    source gives the right bytes anyway (its other path: rank 0's DEST)."""
    dest = prep_cli(_tree(tmp_path / "src"), tmp_path / "dest", "-p", "3")
    hit = _damage(dest, tmp_path / "served")
    client, _ = _run(dest, tmp_path / "served", 1, tmp_path / "out")
    assert len(hit) >= 4
    assert client["mismatched"] == []
    assert {client["c_status"][str(b)] for b in hit} == {-errno.EIO}
    assert client["c"]["corrupt"] >= 2 * len(hit)  # the source's fetch, then the C call alone
    assert client["c"]["py_in_place"] == 0
    assert client["stats"]["c_remote_fallbacks"] >= len(hit)
