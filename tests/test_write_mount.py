"""The write path through real mounts: new files next to the read-only dataset, visible on every
rank after close, staged out at umount, recoverable after a crash (issue 4)."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from _harness import cli_env, first_write_errno, prep_cli, run_cli, status_ranks

pytestmark = [pytest.mark.mount]


@pytest.fixture
def dest(src_tree: Path, tmp_path: Path) -> Path:
    return prep_cli(src_tree, tmp_path / "dest", "--chunk-mib", "1", "-p", "2")


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()
    }


def _torch_save_like(path: Path, payload: bytes, step: int = 4096) -> None:
    with open(path, "wb") as f:  # many small writes, as torch.save does
        for i in range(0, len(payload), step):
            f.write(payload[i : i + step])


@pytest.mark.timeout(120)
def test_single_node_writes_read_back_and_stage_out(dest: Path, tmp_path: Path, mount_factory):
    m = mount_factory(dest, local=str(tmp_path / "local"))
    p = m.path
    rng = random.Random(4)
    ckpt = rng.randbytes(20 << 20)
    (p / "ckpt").mkdir()
    _torch_save_like(p / "ckpt" / "model.pt", ckpt)
    assert (p / "ckpt" / "model.pt").read_bytes() == ckpt
    # into a dataset directory, append and overwrite
    (p / "classes" / "notes.txt").write_text("one\n")
    with open(p / "classes" / "notes.txt", "a") as f:
        f.write("two\n")
    assert (p / "classes" / "notes.txt").read_text() == "one\ntwo\n"
    (p / "classes" / "notes.txt").write_text("over\n")
    assert (p / "classes" / "notes.txt").read_text() == "over\n"
    # truncate, rename, unlink, rmdir
    os.truncate(p / "ckpt" / "model.pt", 1000)
    assert (p / "ckpt" / "model.pt").read_bytes() == ckpt[:1000]
    os.rename(p / "ckpt" / "model.pt", p / "ckpt" / "final.pt")
    assert sorted(os.listdir(p / "ckpt")) == ["final.pt"]
    (p / "tmp.txt").write_text("x")
    os.unlink(p / "tmp.txt")
    (p / "gone").mkdir()
    os.rmdir(p / "gone")
    assert not (p / "gone").exists() and not (p / "tmp.txt").exists()
    # the dataset stays read-only, and its names are taken
    for op, code in [
        (lambda: open(p / "empty", "w"), errno.EROFS),
        (lambda: os.unlink(p / "big.bin"), errno.EROFS),
        (lambda: os.mkdir(p / "classes"), errno.EEXIST),
        (lambda: os.rename(p / "ckpt" / "final.pt", p / "big.bin"), errno.EROFS),
    ]:
        with pytest.raises(OSError) as ei:
            op()
        assert ei.value.errno == code
    os.chmod(p / "ckpt" / "final.pt", 0o600)
    assert (p / "ckpt" / "final.pt").stat().st_mode & 0o777 == 0o600
    st = status_ranks(m.status())[0]
    assert st["writes"]["bytes_written"] >= len(ckpt)
    out = tmp_path / "out"
    r = run_cli("umount", m.template, "--stage-out", out, env=m.env)
    m.umount_result = r
    assert "staged out 2 files" in r.stderr
    assert _tree_bytes(out) == {"ckpt/final.pt": ckpt[:1000], "classes/notes.txt": b"over\n"}
    assert (out / "ckpt" / "final.pt").stat().st_mode & 0o777 == 0o600
    assert not (tmp_path / "local").exists()


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_written_on_one_rank_read_on_another_after_close(dest: Path, tmp_path: Path,
                                                          mount_factory):
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=3,
                      local=str(tmp_path / "local" / "{rank}"))
    r0, r1, r2 = (Path(mp) for mp in m.mountpoints)
    rng = random.Random(7)
    written: dict[str, bytes] = {}
    (r1 / "ckpt").mkdir()
    for k in range(3):
        data = rng.randbytes(rng.choice([0, 1, 5000, (6 << 20) + 17]))
        _torch_save_like(r1 / "ckpt" / f"epoch{k}.pt", data, 65536)
        written[f"ckpt/epoch{k}.pt"] = data
        # right after close, every other rank sees the final size and bytes
        for other in (r0, r2):
            assert (other / "ckpt" / f"epoch{k}.pt").stat().st_size == len(data)
            assert (other / "ckpt" / f"epoch{k}.pt").read_bytes() == data
    assert sorted(os.listdir(r2 / "ckpt")) == ["epoch0.pt", "epoch1.pt", "epoch2.pt"]
    # logs appended on rank 2 are read on rank 0 after each close
    log = r2 / "a" / "b" / "train.log"
    text = ""
    for step in range(5):
        with open(log, "a") as f:
            f.write(f"step {step}\n")
        text += f"step {step}\n"
        assert (r0 / "a" / "b" / "train.log").read_text() == text
    written["a/b/train.log"] = text.encode()
    # only the writing rank may change a file; a name written elsewhere is taken
    with pytest.raises(OSError) as ei:
        os.unlink(r0 / "ckpt" / "epoch0.pt")
    assert ei.value.errno == errno.EPERM
    with pytest.raises(OSError) as ei:
        open(r0 / "ckpt" / "epoch0.pt", "wb")  # the truncation
    assert ei.value.errno == errno.EPERM
    # files open without OPEN (with the patched pyfuse3, the default): the open itself
    # succeeds, the first write fails
    assert first_write_errno(r0 / "ckpt" / "epoch0.pt") == errno.EPERM
    assert (r0 / "ckpt" / "epoch0.pt").read_bytes() == written["ckpt/epoch0.pt"]
    os.rename(r1 / "ckpt" / "epoch2.pt", r1 / "ckpt" / "last.pt")
    written["ckpt/last.pt"] = written.pop("ckpt/epoch2.pt")
    assert sorted(os.listdir(r0 / "ckpt")) == ["epoch0.pt", "epoch1.pt", "last.pt"]
    assert (r0 / "ckpt" / "last.pt").read_bytes() == written["ckpt/last.pt"]
    out = tmp_path / "out"
    r = run_cli("umount", m.template, "--stage-out", out, env=m.env)
    m.umount_result = r
    assert _tree_bytes(out) == written
    assert not list((tmp_path / "local").glob("*/*"))


@pytest.mark.timeout(120)
def test_full_local_disk_gives_enospc_and_keeps_earlier_data(dest: Path, tmp_path: Path,
                                                              mount_factory):
    local = tmp_path / "tmpfs"
    local.mkdir()
    size = sum(f.stat().st_size for f in dest.iterdir()) + (3 << 20)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(local)], check=True)
    try:
        m = mount_factory(dest, local=str(local / "l"))
        first = os.urandom(1 << 20)
        (m.path / "first.bin").write_bytes(first)
        with pytest.raises(OSError) as ei, open(m.path / "huge.bin", "wb") as f:
            for _ in range(64):
                f.write(os.urandom(1 << 20))
                f.flush()
        assert ei.value.errno == errno.ENOSPC
        assert (m.path / "first.bin").read_bytes() == first
        assert "ENOSPC" in m.log_text() or "No space" in m.log_text() or "full" in m.log_text()
        m.umount()
    finally:
        subprocess.run(["umount", "-l", str(local)], check=False)


@pytest.mark.timeout(120)
def test_write_quota(dest: Path, tmp_path: Path, mount_factory):
    m = mount_factory(dest, extra_args=["--write-quota", "2M"])
    (m.path / "ok.bin").write_bytes(b"x" * (1 << 20))
    with pytest.raises(OSError) as ei:
        (m.path / "too-big.bin").write_bytes(b"y" * (3 << 20))
    assert ei.value.errno in (errno.EDQUOT, errno.ENOSPC)
    assert (m.path / "ok.bin").read_bytes() == b"x" * (1 << 20)


@pytest.mark.timeout(120)
def test_sigkill_then_recover_rescues_every_closed_file(dest: Path, tmp_path: Path,
                                                        mount_factory):
    local = tmp_path / "local"
    m = mount_factory(dest, local=str(local))
    closed = {}
    (m.path / "out").mkdir()
    for k in range(5):
        data = os.urandom(100_000 * (k + 1))
        (m.path / "out" / f"f{k}.bin").write_bytes(data)
        closed[f"out/f{k}.bin"] = data
    # Files open without OPEN (the default): the daemon sees no close, and commits a written
    # file once it was idle for IDLE_CLOSE (0.25 s); a crash within that window leaves it unclosed.
    deadline = time.monotonic() + 15
    while status_ranks(m.status())[0]["writes"]["commits"] < 5:
        assert time.monotonic() < deadline, status_ranks(m.status())[0]["writes"]
        time.sleep(0.1)
    f = open(m.path / "out" / "unclosed.bin", "wb")
    f.write(b"partial" * 1000)
    f.flush()
    st = m.state()
    assert st is not None
    os.kill(st.pids[0], signal.SIGKILL)
    time.sleep(0.3)
    with contextlib.suppress(OSError):
        f.close()
    # umount of the dead mount cleans up but keeps the written data for recover
    r = m.umount()
    assert "recover" in r.stderr
    assert not os.path.ismount(m.path)
    out = tmp_path / "rescued"
    r = run_cli("recover", local, "--stage-out", out, env=cli_env(m.state_dir), check=False)
    assert _tree_bytes(out) == closed, r.stderr
    assert "unclosed" in r.stderr and "unclosed.bin" in r.stderr  # reported, not lost silently
    assert r.returncode == 0, r.stderr  # every closed file was saved
    # a new mount over a local dir with unrecovered writes is refused with a clear message
    r = run_cli("mount", dest, m.path, "--local", local, env=cli_env(m.state_dir), check=False)
    assert r.returncode != 0 and "recover" in r.stderr


@pytest.mark.timeout(180)
def test_fsx_style_random_ops_through_the_mount(dest: Path, tmp_path: Path, mount_factory):
    """fsx-style: random pwrite/truncate/pread/reopen on one file through FUSE, every read
    compared with an in-memory model; the final bytes again after stage-out."""
    m = mount_factory(dest, local=str(tmp_path / "local"))
    path = m.path / "fsx.bin"
    rng = random.Random(1234)
    model = bytearray()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        for step in range(1500):
            op = rng.random()
            if op < 0.45:
                off = rng.randrange(0, len(model) + 70_000)
                data = rng.randbytes(rng.randrange(1, 70_000))
                assert os.pwrite(fd, data, off) == len(data)
                if off > len(model):
                    model.extend(bytes(off - len(model)))
                model[off : off + len(data)] = data
            elif op < 0.55:
                size = rng.randrange(0, len(model) + 50_000)
                os.ftruncate(fd, size)
                model = model[:size] + bytearray(max(0, size - len(model)))
            elif op < 0.95:
                off = rng.randrange(0, len(model) + 10)
                n = rng.randrange(0, 100_000)
                assert os.pread(fd, n, off) == bytes(model[off : off + n]), step
            else:  # close and reopen: a commit, then reads through a fresh open
                os.close(fd)
                fd = os.open(path, os.O_RDWR)
            assert os.fstat(fd).st_size == len(model), step
    finally:
        os.close(fd)
    assert path.read_bytes() == bytes(model)
    out = tmp_path / "out"
    r = run_cli("umount", m.template, "--stage-out", out, env=m.env)
    m.umount_result = r
    assert (out / "fsx.bin").read_bytes() == bytes(model)


@pytest.mark.timeout(300)
def test_dataset_reads_flow_while_a_1gb_checkpoint_commits(tmp_path: Path, mount_factory):
    """fsync(2) of a 1 GiB checkpoint fsyncs and hashes it. Dataset listings and reads issued
    after that fsync started must complete before it returns: an ordering, not a timing. The
    checkpoint is rewritten at offset 0 last, so the commit hashes the whole file again."""
    src = tmp_path / "src"
    for d in range(4):
        (src / f"d{d}").mkdir(parents=True)
        for i in range(200):
            (src / f"d{d}" / f"f{i:03d}").write_bytes(bytes([i]) * (3000 + i))
    dest = prep_cli(src, tmp_path / "dest", "-p", "2")
    m = mount_factory(dest, local=str(tmp_path / "local"))
    closing, closed = threading.Event(), threading.Event()
    block = os.urandom(8 << 20)

    def write_checkpoint() -> None:
        fd = os.open(m.path / "ckpt.bin", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            for k in range(128):  # 1 GiB
                os.pwrite(fd, block, k * len(block))
            os.pwrite(fd, b"!", 0)
        finally:
            closing.set()
            os.fsync(fd)  # the commit: fsync + xxh3 of 1 GiB, then the journal
            closed.set()
            os.close(fd)  # (without OPEN, close does not wait for a commit: RELEASE does it)

    writer = threading.Thread(target=write_checkpoint)
    writer.start()
    assert closing.wait(240), "the checkpoint was not written"
    inside = 0  # dataset operations issued after the close started, done before it returned
    ops = 0
    while not closed.is_set() and ops < 100_000:
        d = ops % 4
        i = (ops // 4) % 200
        issued_after_start = closing.is_set()
        names = os.listdir(m.path / f"d{d}")
        data = (m.path / f"d{d}" / f"f{i:03d}").read_bytes()
        assert len(names) == 200 and data == bytes([i]) * (3000 + i)
        if issued_after_start and not closed.is_set():
            inside += 1
        ops += 1
    writer.join(60)
    assert closed.is_set()
    assert (m.path / "ckpt.bin").stat().st_size == 1 << 30
    print(f"{inside} dataset operations completed during the commit")
    assert inside >= 1, "no dataset operation completed while the checkpoint was committed"
