"""The command line without mounting: prep/verify output and exit codes, clear errors."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from _harness import CLI, cli_env, run_cli

from fanstore_fuse._format import MANIFEST_NAME
from fanstore_fuse._manifest import read_manifest


@pytest.fixture
def src(tmp_path: Path) -> Path:
    s = tmp_path / "src"
    (s / "train" / "cat").mkdir(parents=True)
    (s / "val").mkdir()
    for k in range(20):
        (s / "train" / "cat" / f"{k}.txt").write_bytes(f"cat {k}\n".encode() * 50)
    (s / "val" / "v.txt").write_bytes(b"val\n")
    os.symlink("train", s / "t")
    return s


def _one_line_error(r) -> str:
    assert r.returncode != 0
    msg = r.stderr.strip()
    assert msg.startswith("fanstore-fuse:") and "Traceback" not in msg, r.stderr
    return "".join(msg.split())  # rich may wrap it: compare without whitespace


def test_prep_and_verify(src: Path, tmp_path: Path):
    dest = tmp_path / "dest"
    r = run_cli("prep", src, dest, "-p", "3", "--broadcast", "val", "--workers", "2",
                "--level", "5", "--chunk-mib", "1")
    assert "prepped 21 files" in r.stderr and "1 symlinks" in r.stderr and "4 partitions" in r.stderr
    m = read_manifest(dest / MANIFEST_NAME)
    assert m.options == {"codec": "zstd", "level": 5, "chunk_size": 1 << 20, "partitions": 3,
                         "broadcast": ["val"], "frame_size": 128 << 10, "dict": "off"}
    assert [p.name for p in m.partitions if p.broadcast] == ["bcast-00003.fsp"]
    r = run_cli("verify", dest)
    assert r.stdout.strip().endswith(": OK")
    r = run_cli("verify", dest, "--json")
    rep = json.loads(r.stdout)
    assert rep["ok"] and rep["entries"] == m.n_entries and rep["problems"] == []
    # --quiet prints nothing.
    r = run_cli("prep", src, tmp_path / "d2", "--quiet", "--codec", "none")
    assert r.stderr == ""
    assert read_manifest(tmp_path / "d2" / MANIFEST_NAME).options["codec"] == "none"


def test_verify_reports_damage(src: Path, tmp_path: Path):
    dest = tmp_path / "dest"
    run_cli("prep", src, dest, "-p", "1", "--codec", "none", "--quiet")
    part = dest / "part-00000.fsp"
    data = bytearray(part.read_bytes())
    data[-3] ^= 0xFF  # the last file's bytes
    part.write_bytes(bytes(data))
    r = run_cli("verify", dest, check=False)
    assert r.returncode == 1
    assert "damaged:" in r.stderr and "1 problem(s)" in r.stdout
    r = run_cli("verify", dest, "--json", check=False)
    rep = json.loads(r.stdout)
    assert r.returncode == 1 and not rep["ok"] and len(rep["problems"]) == 1
    assert "part-00000.fsp" in rep["problems"][0] and "checksum" in rep["problems"][0]
    # A corrupt manifest: exit non-zero with a clear message.
    man = dest / MANIFEST_NAME
    raw = bytearray(man.read_bytes())
    raw[-1] ^= 1
    man.write_bytes(bytes(raw))
    assert "checksum" in _one_line_error(run_cli("verify", dest, check=False))


def test_prep_errors(src: Path, tmp_path: Path):
    assert "codec" in _one_line_error(run_cli("prep", src, tmp_path / "d", "--codec", "lz4", check=False))
    assert "partitions" in _one_line_error(run_cli("prep", src, tmp_path / "d", "-p", "0", check=False))
    assert "notadirectory" in _one_line_error(
        run_cli("prep", src / "val" / "v.txt", tmp_path / "d", check=False))
    msg = _one_line_error(run_cli("prep", tmp_path / "missing", tmp_path / "d", check=False))
    assert "missing" in msg
    assert "manifest" in _one_line_error(run_cli("verify", tmp_path / "nothing", check=False))


def test_help_and_entry_points():
    r = run_cli("--help")
    for cmd in ("prep", "verify", "mount", "umount", "status"):
        assert cmd in r.stdout
    r = run_cli("mount", "--help")
    assert "--local" in r.stdout and "--foreground" in r.stdout
    exe = Path(sys.executable).parent / "fanstore-fuse"
    script = str(exe) if exe.exists() else shutil.which("fanstore-fuse")
    if script:
        import subprocess

        out = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "prep" in out.stdout
    assert CLI[1:] == ["-m", "fanstore_fuse"]


def test_status_and_umount_of_non_mounts(tmp_path: Path):
    env = cli_env(tmp_path / "state")
    assert "nostatus" in _one_line_error(run_cli("status", tmp_path, env=env, check=False))
    msg = _one_line_error(run_cli("umount", tmp_path, env=env, check=False))
    assert "notafanstore-fusemount" in msg


@pytest.mark.timeout(60)
def test_local_dir_lock_is_held_for_the_process_life(tmp_path: Path):
    """`prepare_local_dir` locks the dir before touching it: another process is refused (with
    the holder's pid) until the holder ends; a foreign non-empty dir keeps no lock file."""
    import subprocess

    from fanstore_fuse import _mountctl

    local = tmp_path / "local"
    code = ("import sys; from fanstore_fuse._mountctl import prepare_local_dir; "
            "prepare_local_dir(sys.argv[1]); print('held', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code, str(local)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        before = sorted(os.listdir(local))
        with pytest.raises(_mountctl.LocalDirBusy, match=f"in use by a live mount \\(pid {holder.pid}\\)"):
            _mountctl.prepare_local_dir(str(local))
        assert sorted(os.listdir(local)) == before
        assert _mountctl.local_dir_in_use(str(local))
        _mountctl.remove_local_dir(str(local))  # a live daemon's dir is left alone
        assert sorted(os.listdir(local)) == before
    finally:
        holder.communicate("", timeout=30)
    assert not _mountctl.local_dir_in_use(str(local))
    assert _mountctl.prepare_local_dir(str(local)) == str(local)  # the holder ended: ours now
    _mountctl.remove_local_dir(str(local))
    assert not local.exists()
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    (foreign / "theirs").write_text("x")
    with pytest.raises(Exception, match="not empty and not ours"):
        _mountctl.prepare_local_dir(str(foreign))
    assert os.listdir(foreign) == ["theirs"]
