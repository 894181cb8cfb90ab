"""Faults and resources: corruption, full disks, bad mountpoints, dead mounts, a concurrency soak,
and what other users of the node can see.

Each test states the expected outcome in its docstring and asserts it. Figures from these runs
are recorded in docs/reliability.md; set FANSTORE_SOAK_SECONDS to soak longer.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
from _harness import cli_env, fuse_mounts, mounted, prep_cli, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fanstore_fuse import ChecksumError, PrepOptions, prep
from fanstore_fuse._blobstore import BlobStore
from fanstore_fuse._errors import FanstoreError
from fanstore_fuse._format import MANIFEST_NAME, PARTITION_DATA_START
from fanstore_fuse._manifest import read_manifest
from fanstore_fuse._mountctl import prepare_local_dir, remove_local_dir
from fanstore_fuse._namespace import Namespace

pytestmark = pytest.mark.fault
WIDE = {"COLUMNS": "400"}  # rich wraps stderr at 80 columns when it is not a terminal (known)


def _content(i: int, n: int) -> bytes:
    """Deterministic, partly compressible bytes for file i (readers re-derive it from the name)."""
    seed = hashlib.blake2b(b"%d" % i, digest_size=32).digest()
    return (seed * (n // 32 + 1))[: n // 2] + hashlib.shake_128(seed).digest(n - n // 2)


def _small_tree(root: Path, files: int = 40, dirs: int = 4, max_size: int = 9000) -> dict[str, bytes]:
    out = {}
    rng = random.Random(files)
    for i in range(files):
        rel = f"d{i % dirs:02d}/f{i:05d}.bin"
        data = _content(i, rng.randint(0, max_size))
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        out[rel] = data
    return out


def _blob_of(dest: Path, rel: str, k: int = 0) -> tuple[int, str, int]:
    """(blob id, partition name, blob offset) of chunk k of file `rel`."""
    m = read_manifest(dest / MANIFEST_NAME)
    ns = Namespace(m)
    b = ns.blobs(ns.resolve(rel.encode()))[k]
    return b, m.partitions[m.blobs["part"][b]].name, m.blobs["offset"][b]


def _flip(path: Path, offset: int, mask: int = 0x01) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        c = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([c ^ mask]))


# ------------------------------------------------------------------------- 1. corruption


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    base = tmp_path_factory.mktemp("small")
    files = _small_tree(base / "src")
    (base / "src" / "big.bin").write_bytes(_content(999, 3 * 4096 * 4 + 77))
    files["big.bin"] = (base / "src" / "big.bin").read_bytes()
    prep(base / "src", base / "dest", PrepOptions(partitions=3, chunk_size=16384, workers=1))
    return base / "dest", files


def test_verify_names_file_and_partition_for_each_damage(small, tmp_path: Path):
    """Bit flip in a blob, truncated partition, deleted partition, flipped manifest: `verify`
    exits 1 and names the damaged file and partition (or the manifest)."""
    src_dest, files = small
    dest = tmp_path / "dest"
    shutil.copytree(src_dest, dest)
    env = cli_env(None, **WIDE)
    assert run_cli("verify", dest, env=env).returncode == 0

    victim = "d01/f00005.bin"
    _b, part, off = _blob_of(dest, victim)
    _flip(dest / part, off + 3, 0x20)
    r = run_cli("verify", dest, "--json", env=env, check=False)
    assert r.returncode == 1
    rep = json.loads(r.stdout)
    assert not rep["ok"] and len(rep["problems"]) == 1, rep
    assert victim in rep["problems"][0] and part in rep["problems"][0], rep
    _flip(dest / part, off + 3, 0x20)  # undo

    # Truncate partition 0 by 10 bytes (its last blob is cut); delete partition 1.
    m = read_manifest(dest / MANIFEST_NAME)
    ns = Namespace(m)
    tpart, gone = m.partitions[0].name, m.partitions[1].name
    os.truncate(dest / tpart, m.partitions[0].size - 10)
    os.unlink(dest / gone)
    last = max((b for b in range(m.n_blobs) if m.blobs["part"][b] == 0),
               key=lambda b: m.blobs["offset"][b])
    cut = next(os.fsdecode(ns.path(i)) for i in range(len(ns))
               if ns.is_regular(i) and last in ns.blobs(i))
    r = run_cli("verify", dest, env=env, check=False)
    assert r.returncode == 1
    out = r.stderr + r.stdout
    assert f"partition {tpart}:" in out and "manifest says" in out, out
    assert f"partition {gone}: missing" in out, out
    assert f"{cut}: blob {last} (partition {tpart}" in out and "truncated" in out, out
    lost = [rel for rel in files if _blob_parts(m, rel) & {gone}]
    assert lost and all(rel in out for rel in lost), (lost, out)

    # Manifest damage: refused as a whole, one line, exit 1; mount refuses it as well.
    shutil.rmtree(dest)
    shutil.copytree(src_dest, dest)
    _flip(dest / MANIFEST_NAME, 100, 0x04)
    r = run_cli("verify", dest, env=env, check=False)
    assert r.returncode == 1 and "manifest" in r.stderr and "checksum" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def _blob_parts(m, rel: str) -> set[str]:
    ns = Namespace(m)
    return {m.partitions[m.blobs["part"][b]].name for b in ns.blobs(ns.resolve(rel.encode()))}


@pytest.fixture(scope="module")
def flip_dest(tmp_path_factory: pytest.TempPathFactory):
    """A small tree in one zstd partition and one raw partition (blob areas to flip bits in)."""
    base = tmp_path_factory.mktemp("flip")
    files = _small_tree(base / "src", files=24, dirs=3, max_size=6000)
    dests = {}
    for codec in ("zstd", "none"):
        dests[codec] = base / f"dest-{codec}"
        prep(base / "src", dests[codec], PrepOptions(partitions=1, codec=codec, chunk_size=4096,
                                                      workers=1))
    return dests, files


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(codec=st.sampled_from(["zstd", "none"]), where=st.floats(0, 1, exclude_max=True),
       bit=st.integers(0, 7))
def test_single_bit_flip_never_returns_wrong_bytes(flip_dest, codec: str, where: float, bit: int):
    """For a single-bit flip anywhere in a partition's blob area, reading every file through
    BlobStore gives either the exact bytes or ChecksumError — never wrong bytes."""
    dests, files = flip_dest
    dest = dests[codec]
    m = read_manifest(dest / MANIFEST_NAME)
    part = dest / m.partitions[0].name
    size = m.partitions[0].size
    off = PARTITION_DATA_START + int(where * (size - PARTITION_DATA_START))
    _flip(part, off, 1 << bit)
    try:
        store = BlobStore(m, str(dest))
        ns = Namespace(m)
        failed = 0
        try:
            for rel, want in files.items():
                i = ns.resolve(rel.encode())
                try:
                    got = b"".join(store.raw(b) for b in ns.blobs(i))
                except ChecksumError as e:
                    assert m.partitions[0].name in str(e)
                    failed += 1
                    continue
                assert got == want, f"wrong bytes for {rel} after flipping bit {bit} at {off}"
        finally:
            store.close()
        # The flipped byte lies inside some blob (they are packed), so exactly one file fails.
        covering = [b for b in range(m.n_blobs)
                    if m.blobs["offset"][b] <= off < m.blobs["offset"][b] + m.blobs["stored"][b]]
        assert failed == (1 if covering else 0)
    finally:
        _flip(part, off, 1 << bit)


@pytest.mark.mount
@pytest.mark.timeout(120)
def test_damaged_dest_partitions_on_a_single_node_mount(small, tmp_path: Path, state_dir: Path):
    """Flipped bit in DEST: the mount comes up, the damaged file reads EIO (a log line names file
    and partition), every other file reads exact bytes. Truncated or deleted DEST partition:
    stage-in refuses with a one-line message naming the partition, nothing mounted, local cleaned."""
    src_dest, files = small
    dest = tmp_path / "dest"
    shutil.copytree(src_dest, dest)
    victim = "d02/f00010.bin"
    assert files[victim], "victim must not be empty"
    _b, part, off = _blob_of(dest, victim)
    _flip(dest / part, off + 1, 0x80)
    local = tmp_path / "local"
    with mounted(dest, tmp_path / "mp", state_dir, local=local) as m:
        with pytest.raises(OSError) as ei:
            (m.path / victim).read_bytes()
        assert ei.value.errno == errno.EIO
        for rel, want in files.items():
            if rel != victim:
                assert (m.path / rel).read_bytes() == want, rel
        m.umount()
        log = m.log_text()
        line = next((ln for ln in log.splitlines() if victim in ln and "ERROR" in ln), "")
        assert part in line, log[-2000:]
    assert not local.exists()

    env = cli_env(state_dir, **WIDE)
    mp = tmp_path / "mp2"
    mp.mkdir()
    for damage in ("truncate", "delete"):
        shutil.rmtree(dest)
        shutil.copytree(src_dest, dest)
        if damage == "truncate":
            os.truncate(dest / part, os.path.getsize(dest / part) - 1)
        else:
            os.unlink(dest / part)
        r = run_cli("mount", dest, mp, "--local", local, env=env, check=False, timeout=60)
        assert r.returncode != 0
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and part in lines[0], r.stderr
        assert str(mp) not in fuse_mounts() and not os.listdir(mp)
        assert not local.exists() or not os.listdir(local), os.listdir(local)
        assert not list(state_dir.glob("*.json"))


# ------------------------------------------------------------------------- 2. resources


@contextlib.contextmanager
def _tmpfs(path: Path, size: str = "2m"):
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture(scope="module")
def big_dest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~3 MiB of incompressible data in 2 partitions: more than a 2 MiB tmpfs holds."""
    base = tmp_path_factory.mktemp("big")
    for i in range(6):
        (base / "src").mkdir(exist_ok=True)
        (base / "src" / f"r{i}.bin").write_bytes(os.urandom(512 * 1024))
    prep(base / "src", base / "dest", PrepOptions(partitions=2, codec="none", workers=1))
    return base / "dest"


@pytest.mark.mount
@pytest.mark.timeout(60)
def test_full_local_dir_fails_cleanly(big_dest: Path, tmp_path: Path, state_dir: Path):
    """Local dir on a 2 MiB tmpfs, dataset 3 MiB: mount exits non-zero with one line saying how
    much space there is and is needed; nothing mounted, no daemon, the local copy removed."""
    with _tmpfs(tmp_path / "small-fs") as fs:
        mp = tmp_path / "mp"
        mp.mkdir()
        local = fs / "local"
        r = run_cli("mount", big_dest, mp, "--local", local, env=cli_env(state_dir, **WIDE),
                    check=False, timeout=60)
        assert r.returncode != 0
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "free" in lines[0] and "needs" in lines[0], r.stderr
        assert str(mp) not in fuse_mounts() and not os.listdir(mp)
        assert not local.exists(), os.listdir(local)
        assert not list(state_dir.glob("*.json"))
        assert shutil.disk_usage(fs).used < 64 * 1024


def test_disk_filling_during_stage_in_is_a_clear_error(big_dest: Path, tmp_path: Path, monkeypatch):
    """The free-space check passes (another job could still fill the disk afterwards), then the
    copy hits ENOSPC: stage_in raises 'is full (ENOSPC)' and the local dir can be removed whole."""
    from fanstore_fuse import _stage

    real = os.statvfs

    class Roomy:
        def __init__(self, st):
            self.f_frsize, self.f_bavail = st.f_frsize, 1 << 40

    monkeypatch.setattr(_stage.os, "statvfs", lambda p: Roomy(real(p)))
    m = read_manifest(big_dest / MANIFEST_NAME)
    with _tmpfs(tmp_path / "small-fs") as fs:
        local = prepare_local_dir(str(fs / "local"))
        with pytest.raises(FanstoreError, match="full|ENOSPC|space") as ei:
            _stage.stage_in(str(big_dest), local, m)
        monkeypatch.undo()
        assert str(fs) in str(ei.value)
        remove_local_dir(local)
        assert not os.path.exists(local)
        assert shutil.disk_usage(fs).used < 64 * 1024


@pytest.mark.mount
@pytest.mark.timeout(60)
def test_bad_mountpoints_give_clear_errors(small, tmp_path: Path, state_dir: Path):
    """Missing, a file, not empty, read-only (bind mount), already mounted: one line each,
    exit != 0, nothing (new) mounted."""
    dest, files = small
    env = cli_env(state_dir, **WIDE)

    def fails(mp: Path, want: str) -> None:
        before = fuse_mounts().get(str(mp))
        r = run_cli("mount", dest, mp, env=env, check=False, timeout=60)
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and len(lines) == 1 and want in lines[0], r.stderr
        assert fuse_mounts().get(str(mp)) == before

    fails(tmp_path / "missing", "does not exist")
    (tmp_path / "file").write_text("x")
    fails(tmp_path / "file", "not a directory")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    fails(tmp_path / "full", "not empty")
    ro = tmp_path / "ro"
    (ro / "mp").mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(ro), str(ro)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], check=True)
        fails(ro / "mp", "not writable")
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=True)
    with mounted(dest, tmp_path / "mp", state_dir) as m:
        fails(m.path, "already a mount")
        assert (m.path / "big.bin").read_bytes() == files["big.bin"]  # the first mount still serves
    assert str(tmp_path / "mp") not in fuse_mounts()


@pytest.mark.mount
@pytest.mark.timeout(90)
def test_sigkilled_daemon_leaves_a_dead_mount_that_umount_clears(small, tmp_path: Path,
                                                                  state_dir: Path):
    """SIGKILL the single-node daemon while a reader loops: the reader gets an errno (ENOTCONN)
    within 5 s, `umount` clears the dead mount and the local copy, a new mount serves exact bytes."""
    dest, files = small
    mp, local = tmp_path / "mp", tmp_path / "local"
    errors: list[int] = []
    with mounted(dest, mp, state_dir, local=local) as m:
        stop = threading.Event()

        def reader() -> None:
            names = sorted(files)
            k = 0
            while not stop.is_set():
                try:
                    (m.path / names[k % len(names)]).read_bytes()
                except OSError as e:
                    errors.append(e.errno)
                    return
                k += 1

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        for p in m.pids():
            os.kill(p, signal.SIGKILL)
        t.join(5)
        waited = time.monotonic() - t0
        stop.set()
        assert not t.is_alive(), "reader hung on a dead mount"
        assert errors and errors[0] in (errno.ENOTCONN, errno.ECONNABORTED), errors
        assert waited < 5
        r = m.umount()
        assert r.returncode == 0 and str(mp) not in fuse_mounts()
        assert not local.exists()
    with mounted(dest, mp, state_dir, local=local) as m2:
        for rel, want in files.items():
            assert (m2.path / rel).read_bytes() == want
    assert m2.forced == [] and str(mp) not in fuse_mounts()


# ------------------------------------------------------------------------- 4. soak

SOAK_FILES = 3000
SOAK_SECONDS = float(os.environ.get("FANSTORE_SOAK_SECONDS", "15"))


def _soak_size(i: int) -> int:
    return (i * 7919) % 6000 + (i % 3)


def _soak_worker(mps: list[str], deadline: float, seed: int) -> tuple[int, int, int, list[str]]:
    """Read random files from random ranks until the deadline; (files, bytes, errors, samples)."""
    rng = random.Random(seed)
    n = nbytes = 0
    errs: list[str] = []
    while time.time() < deadline:
        i = rng.randrange(SOAK_FILES)
        p = os.path.join(rng.choice(mps), f"s{i % 30:02d}", f"f{i:05d}.bin")
        try:
            with open(p, "rb") as f:
                data = f.read()
        except OSError as e:
            errs.append(f"{p}: {e}")
            continue
        if data != _content(i, _soak_size(i)):
            errs.append(f"{p}: wrong bytes")
            continue
        n += 1
        nbytes += len(data)
    return n, nbytes, len(errs), errs[:5]


def _soak_proc(args) -> tuple[int, int, int, list[str]]:
    return _soak_worker(*args)


@pytest.mark.mount
@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_concurrency_soak_three_ranks(tmp_path: Path, mount_factory):
    """8 threads + 8 processes read random files of 3,000 through 3 ranks' mounts for a bounded
    time: zero errors, every byte compared with what was written."""
    src = tmp_path / "src"
    for i in range(SOAK_FILES):
        p = src / f"s{i % 30:02d}" / f"f{i:05d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(_content(i, _soak_size(i)))
    dest = prep_cli(src, tmp_path / "dest", "-p", "3")
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=3,
                      local=str(tmp_path / "local" / "{rank}"), extra_args=["--replicas", "2"])
    deadline = time.time() + SOAK_SECONDS
    results: list[tuple[int, int, int, list[str]]] = []
    lock = threading.Lock()

    def thread_main(seed: int) -> None:
        r = _soak_worker(m.mountpoints, deadline, seed)
        with lock:
            results.append(r)

    t0 = time.monotonic()
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(8) as pool:
        async_res = pool.map_async(_soak_proc, [(m.mountpoints, deadline, 100 + k) for k in range(8)])
        threads = [threading.Thread(target=thread_main, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(SOAK_SECONDS + 60)
        results += async_res.get(SOAK_SECONDS + 60)
    elapsed = time.monotonic() - t0
    files = sum(r[0] for r in results)
    nbytes = sum(r[1] for r in results)
    nerr = sum(r[2] for r in results)
    samples = [s for r in results for s in r[3]]
    print(f"soak: 16 readers, {elapsed:.1f} s, {files} files, {nbytes} bytes verified, "
          f"{nerr} errors, {files / elapsed:.0f} files/s")
    assert len(results) == 16
    assert nerr == 0, samples
    assert files > 1000 and all(r[0] > 0 for r in results)
    m.umount()
    assert not list((tmp_path / "local").glob("*/*"))


# ------------------------------------------------------------------------- 5. security

NOBODY = 65534


def _as_nobody(fn) -> int:
    """Run fn() in a forked child as uid/gid 65534; return 0 or the errno it raised."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 0
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            fn()
        except OSError as e:
            code = e.errno or 255
        except BaseException:
            code = 254
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _mount_options(mp: str) -> set[str]:
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if fields[1] == mp:
                return set(fields[3].split(","))
    raise AssertionError(f"{mp} not mounted")


@pytest.fixture
def public_dir():
    """A world-traversable directory (pytest's tmp dirs are 0700: another uid would get EACCES
    there before ever reaching the mount)."""
    d = tempfile.mkdtemp(prefix="fanstore-sec-", dir="/tmp")
    os.chmod(d, 0o755)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def _tree_state(root: Path) -> dict[str, tuple]:
    out = {}
    for dp, dns, fns in os.walk(root):
        for n in dns + fns:
            p = os.path.join(dp, n)
            s = os.lstat(p)
            out[os.path.relpath(p, root)] = (s.st_mode, s.st_size, s.st_mtime_ns)
    return out


def _permission_tree(public_dir: Path) -> Path:
    """A world-readable file and an owner-only one, in a directory everyone may enter."""
    src = public_dir / "src"
    src.mkdir()
    os.chmod(src, 0o755)
    (src / "public.txt").write_bytes(b"world readable\n")
    os.chmod(src / "public.txt", 0o644)
    (src / "secret.txt").write_bytes(b"owner only\n")
    os.chmod(src / "secret.txt", 0o600)
    return src


@pytest.mark.mount
@pytest.mark.timeout(120)
def test_mount_is_private_and_writes_nowhere_else(public_dir: Path, tmp_path: Path):
    """Default mount: no allow_other, default_permissions, nosuid, nodev; uid 65534 gets EACCES
    for stat, read and the status xattr; set[ug]id bits from the source never appear; nothing is
    written outside the local and state dirs (DEST, SRC and TMPDIR unchanged afterwards)."""
    src = _permission_tree(public_dir)
    (src / "suid").write_bytes(b"#!/bin/sh\n")
    os.chmod(src / "suid", 0o6755)
    dest = public_dir / "dest"
    prep(src, dest, PrepOptions(partitions=1, workers=1))
    tmpdir = public_dir / "tmp"
    tmpdir.mkdir()
    state = public_dir / "state"
    env = cli_env(state, TMPDIR=str(tmpdir), **WIDE)
    before = {d: _tree_state(d) for d in (src, dest, tmpdir)}
    mp = public_dir / "mp"
    mp.mkdir()
    os.chmod(mp, 0o755)
    run_cli("mount", dest, mp, env=env)
    try:
        opts = _mount_options(str(mp))
        assert "allow_other" not in opts and "default_permissions" in opts, opts
        assert {"nosuid", "nodev"} <= opts, opts
        assert os.stat(mp / "suid").st_mode & 0o7777 == 0o755
        assert _as_nobody(lambda: os.stat(public_dir)) == 0  # the way there is open ...
        assert _as_nobody(lambda: os.stat(mp)) == errno.EACCES  # ... the mount is not
        assert _as_nobody(lambda: open(mp / "public.txt", "rb").read()) == errno.EACCES
        assert _as_nobody(lambda: os.getxattr(mp, "user.fanstore.status")) == errno.EACCES
        assert (mp / "public.txt").read_bytes() == b"world readable\n"
        assert json.loads(os.getxattr(mp, "user.fanstore.status"))
        # Only the default local dir (under TMPDIR) and the state dir were written.
        during = _tree_state(tmpdir)
        assert all(p.startswith(f"fanstore-fuse-{os.getuid()}") for p in during), sorted(during)
    finally:
        run_cli("umount", mp, env=env, check=False)
        if str(mp) in fuse_mounts():
            subprocess.run(["fusermount3", "-u", "-z", str(mp)])
    assert str(mp) not in fuse_mounts()
    assert os.listdir(mp) == []
    after = {d: _tree_state(d) for d in (src, dest, tmpdir)}
    leftover = {p for p in after[tmpdir] if p not in before[tmpdir]}
    # An empty per-user directory may stay (it holds default local dirs); nothing in it.
    assert all(not os.listdir(tmpdir / p) for p in leftover if (tmpdir / p).is_dir()), leftover
    assert after[src] == before[src] and after[dest] == before[dest]
    assert not [p for p in os.listdir(state) if not p.endswith(".log")], os.listdir(state)


@pytest.mark.mount
@pytest.mark.timeout(120)
def test_allow_other_still_enforces_permissions_and_guards_status(public_dir: Path, tmp_path: Path):
    """With -o allow_other: uid 65534 reads a 0644 file, gets EACCES on a 0600 file
    (default_permissions) and on the status xattr; listxattr on the root hides it from them."""
    src = _permission_tree(public_dir)
    dest = public_dir / "dest"
    prep(src, dest, PrepOptions(partitions=1, workers=1))
    state = tmp_path / "state"
    mp = public_dir / "mp"
    with mounted(dest, mp, state, local=tmp_path / "local", extra_args=["-o", "allow_other"]) as m:
        assert "allow_other" in _mount_options(str(mp))

        def read_public() -> None:
            if open(mp / "public.txt", "rb").read() != b"world readable\n":
                raise OSError(errno.EBADMSG, "wrong bytes")

        def list_status() -> None:
            if any("status" in n for n in os.listxattr(mp)):
                raise OSError(errno.EEXIST, "status listed")

        assert _as_nobody(read_public) == 0
        assert _as_nobody(lambda: open(mp / "secret.txt", "rb").read()) == errno.EACCES
        assert _as_nobody(lambda: os.getxattr(mp, "user.fanstore.status")) in (errno.EACCES,
                                                                                errno.EPERM)
        assert _as_nobody(list_status) == 0
        assert _as_nobody(lambda: open(mp / "public.txt", "r+b")) in (errno.EROFS, errno.EACCES)
        assert json.loads(os.getxattr(mp, "user.fanstore.status"))
        m.umount()
    assert m.forced == []
