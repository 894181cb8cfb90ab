"""Local dirs whose written files were saved: marked by a verified stage-out or `recover`, then
removed where unsaved written files would be kept (umount, a daemon's teardown, the epilog);
any later change makes them unsaved again. No FUSE, no MPI."""

from __future__ import annotations

import os
from pathlib import Path

from fanstore_fuse._mountctl import (
    SAVED_MARKER,
    has_written_files,
    prepare_local_dir,
    remove_local_dir,
    saved_to,
    unsaved_writes,
)
from fanstore_fuse._recover import recover
from fanstore_fuse._slurmjob import JobPlan, user_epilog
from fanstore_fuse._stageout_all import _stage_local
from fanstore_fuse.writes import WriteStore


def _written(local: Path, files: dict[str, bytes]) -> None:
    prepare_local_dir(str(local))
    s = WriteStore(str(local))
    for path, data in files.items():
        fh, _ = s.create(path, 0o644)
        s.write(fh, 0, data)
        s.close(fh)
    s.close_store()


def _plan(tmp_path: Path, local: Path) -> JobPlan:
    return JobPlan("7", "root", 0, 0, "", str(tmp_path / "mnt"), str(local), "", -1, 0,
                   state_dir=str(tmp_path / "state"), node="n0")


def test_recover_marks_saved_and_the_epilog_removes_it(tmp_path: Path) -> None:
    local, out = tmp_path / "local", tmp_path / "out"
    data = {"ckpt.pt": os.urandom(300_000), "log.txt": b"epoch 1\n"}
    _written(local, data)
    assert unsaved_writes(str(local)) and saved_to(str(local)) is None
    summ = recover(str(local), str(out))
    assert summ.ok and summ.files == 2
    assert saved_to(str(local)) == str(out) and not unsaved_writes(str(local))
    for name, want in data.items():
        assert (out / name).read_bytes() == want
    ok, lines = user_epilog(_plan(tmp_path, local))
    assert ok and lines == [f"removed {local}: its written files are saved in {out}"], lines
    assert not local.exists()


def test_a_change_after_the_stage_out_makes_it_unsaved_again(tmp_path: Path) -> None:
    local, out = tmp_path / "local", tmp_path / "out"
    _written(local, {"a.bin": b"a" * 5000})
    assert _stage_local(str(local), str(out))["ok"]  # what a rank does on OP_STAGE_OUT
    assert saved_to(str(local)) == str(out)
    s = WriteStore(str(local))  # the job writes once more
    fh, _ = s.create("b.bin", 0o644)
    s.write(fh, 0, b"b" * 10)
    s.close(fh)
    s.close_store()
    assert saved_to(str(local)) is None and unsaved_writes(str(local))
    remove_local_dir(str(local), keep_writes=True)
    assert has_written_files(str(local)), "unsaved written files were removed"
    ok, lines = user_epilog(_plan(tmp_path, local))
    assert not ok and len(lines) == 1 and lines[0].startswith(f"written files kept in {local}")
    assert local.exists()


def test_unclosed_files_leave_the_dir_unsaved(tmp_path: Path) -> None:
    local, out = tmp_path / "local", tmp_path / "out"
    _written(local, {"done.bin": b"x" * 100})
    s = WriteStore(str(local))
    fh, _ = s.create("open.bin", 0o644)
    s.write(fh, 0, b"partial")
    s.journal.close()  # a crash: the file was never closed
    summ = recover(str(local), str(out))
    assert summ.ok and [u.path for u in summ.unclosed] == ["open.bin"]
    assert not (local / SAVED_MARKER).exists() and unsaved_writes(str(local))
    remove_local_dir(str(local), keep_writes=True)
    assert has_written_files(str(local))
