"""Library level of the hostile-user cases (tests/test_security.py runs the CLI): resolution
beneath a directory (openat2 and the openat walk), private directories and files, the DEST
access record (magic, version, round trip)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

NOBODY = 65534


@pytest.mark.parametrize("openat2", [True, False], ids=["openat2", "openat-walk"])
def test_open_beneath_refuses_symlinks_and_dotdot(tmp_path: Path, monkeypatch, openat2: bool):
    """Both resolvers (openat2 where the kernel has it, the O_NOFOLLOW walk otherwise) refuse
    a symlink at the top and nested, `..` and absolute paths, and make missing directories."""
    from fanstore_fuse import _safepath

    if openat2:
        assert _safepath._openat2_fn() is not None, "openat2 missing on this kernel"
    else:
        monkeypatch.setattr(_safepath, "_openat2_state", [None])
    out, outside = tmp_path / "out", tmp_path / "outside"
    (out / "real" / "deeper").mkdir(parents=True)
    outside.mkdir()
    (out / "top").symlink_to(outside)
    (out / "real" / "nested").symlink_to(outside)
    (out / "real" / "file").write_bytes(b"")
    root = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for rel in ("top", "top/x", "real/nested", "real/nested/y/z", "real/file/x",
                    "../outside", "real/../../outside", "/etc"):
            for create in (False, True):
                with pytest.raises(_safepath.Escape) as e:
                    _safepath.open_beneath(root, rel, create=create, shown=str(out))
                assert str(out) in str(e.value)
        fd = _safepath.open_beneath(root, "real/deeper/new/er", create=True, shown=str(out))
        assert os.path.samestat(os.fstat(fd), os.stat(out / "real/deeper/new/er"))
        os.close(fd)
    finally:
        os.close(root)
    assert list(outside.iterdir()) == []
    if openat2:  # it was used, not found missing (ENOSYS) and replaced by the walk
        assert _safepath._openat2_state[0] is not None


def test_secure_dir_checks(tmp_path: Path):
    from fanstore_fuse._errors import FanstoreError
    from fanstore_fuse._safepath import open_private, secure_dir

    d = secure_dir(str(tmp_path / "a" / "b"), "state directory")
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    wide = tmp_path / "wide"
    wide.mkdir()
    os.chmod(wide, 0o777)  # not sticky: another user could swap what is inside
    with pytest.raises(FanstoreError, match="writable by other users"):
        secure_dir(str(wide / "state"))
    assert not (wide / "state").exists()
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(FanstoreError, match=f"belongs to uid {NOBODY}"):
        secure_dir(str(theirs))
    (tmp_path / "link").symlink_to(d)
    with pytest.raises(FanstoreError, match="is a symlink"):
        secure_dir(str(tmp_path / "link"))
    (tmp_path / "a" / "b" / "f").write_bytes(b"1")
    os.link(tmp_path / "a" / "b" / "f", tmp_path / "a" / "b" / "hard")
    with pytest.raises(FanstoreError, match="one name"):
        open_private(str(tmp_path / "a" / "b" / "hard"), os.O_WRONLY | os.O_APPEND)


def test_access_record_round_trips_and_rejects_garbage():
    from fanstore_fuse._errors import FanstoreError
    from fanstore_fuse._perms import GROUP, OTHERS, OWNER, Access

    for a in (Access(OWNER), Access(GROUP, 0), Access(GROUP, 4242), Access(OTHERS)):
        assert Access.decode(a.encode()) == a
    for bad in (b"", b"fanstore-access 2 owner", b"fanstore-access 1 nobody",
                b"other-magic 1 owner", b"fanstore-access 1 group:x", b"\xff" * 10):
        with pytest.raises(FanstoreError):
            Access.decode(bad)
    assert Access(GROUP, 1).wider_than(Access(OWNER)) and Access(GROUP, 1).wider_than(Access(GROUP, 2))
    assert not Access(OWNER).wider_than(Access(GROUP, 1))
    assert Access(GROUP, 1).narrow(Access(GROUP, 2)) == Access(OWNER)
