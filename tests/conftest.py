"""Shared fixtures. Mounting tests use `mount_factory` (see tests/_harness.py) and carry
`@pytest.mark.mount` plus a `@pytest.mark.timeout`; nothing may stay mounted after a test, and
a session finalizer checks that no FUSE mount is left under pytest's temporary directories."""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness  # noqa: E402

HAVE_FUSE = Path("/dev/fuse").exists() and shutil.which("fusermount3") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_FUSE:
        return
    skip = pytest.mark.skip(reason="no /dev/fuse or fusermount3 on this machine")
    for item in items:
        if "mount" in item.keywords:
            item.add_marker(skip)


class ErrorLog(logging.Handler):
    """Every ERROR (or worse) record logged in this process during one test."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []
        self.expected: list[re.Pattern[str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def expect(self, pattern: str) -> None:
        """ERROR lines matching `pattern` (re.search) are part of what the test checks."""
        self.expected.append(re.compile(pattern))

    def unexpected(self) -> list[str]:
        lines = [f"{r.name}: {r.getMessage()}" for r in self.records]
        return [ln for ln in lines if not any(p.search(ln) for p in self.expected)]


@pytest.fixture(autouse=True)
def error_log() -> Iterator[ErrorLog]:
    """Fail a test that logs an ERROR line it did not declare with `error_log.expect(...)`
    (after s3ql's pytest_checklogs): an error nobody looked at is a bug nobody saw."""
    handler = ErrorLog()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
    bad = handler.unexpected()
    if bad:
        pytest.fail("unexpected ERROR log lines:\n  " + "\n  ".join(bad[:20]), pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def _no_mount_left_behind(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    base = tmp_path_factory.getbasetemp()
    yield
    left = _harness.fuse_mounts_under(base)
    for mp in left:  # clean up first so the machine stays usable, then fail loudly
        _harness.backstop_cleanup([mp], None)
    assert not left, f"FUSE mounts left behind under {base}: {left}"


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An isolated FANSTORE_STATE_DIR for this test (inherited by CLI subprocesses)."""
    d = tmp_path / "state"
    d.mkdir()
    monkeypatch.setenv("FANSTORE_STATE_DIR", str(d))
    return d


@pytest.fixture
def mount_factory(state_dir: Path, tmp_path: Path):
    """`mount_factory(dest, mountpoint=None, **kw)` -> a `_harness.Mount`, unmounted (and
    force-cleaned if need be) at teardown. kw: local, ranks, extra_args, env, timeout."""
    with contextlib.ExitStack() as stack:
        counter = iter(range(1_000_000))

        def factory(dest, mountpoint=None, **kw) -> _harness.Mount:
            if mountpoint is None:
                mountpoint = tmp_path / f"mnt{next(counter)}"
            return stack.enter_context(_harness.mounted(dest, mountpoint, state_dir, **kw))

        yield factory


@pytest.fixture
def src_tree(tmp_path: Path) -> Path:
    """A varied source tree (see `_harness.build_tree`), chunk size 1 MiB in mind."""
    return _harness.build_tree(tmp_path / "src")


HUGE_SIZE = (9 << 29) + 12345  # 4.5 GiB + a bit


@pytest.fixture(scope="session")
def huge_dest(tmp_path_factory: pytest.TempPathFactory):
    """A prepped dataset with one sparse 4.5 GiB file ("huge": zeros, b"at 4 GiB" at 4 GiB,
    b"tail!" at the end), 64 MiB chunks, zstd level 1. Prepped once per session (~10-15 s on 2
    cores: reading the holes and compressing zeros). Returns (dest, size, PrepResult, seconds)."""
    import time

    from fanstore_fuse import PrepOptions, prep

    base = tmp_path_factory.mktemp("huge")
    src = base / "src"
    src.mkdir()
    with open(src / "huge", "wb") as f:
        f.truncate(HUGE_SIZE)
        f.seek(HUGE_SIZE - 5)
        f.write(b"tail!")
        f.seek(4 << 30)
        f.write(b"at 4 GiB")
    t0 = time.perf_counter()
    res = prep(src, base / "dest", PrepOptions(partitions=2, chunk_size=64 << 20, level=1))
    dt = time.perf_counter() - t0
    (src / "huge").unlink()
    return base / "dest", HUGE_SIZE, res, dt


@pytest.fixture
def replies(monkeypatch):
    """What readdir sends, per call: [(name, inode, next_id)], with an optional cut-off
    (pyfuse3.readdir_reply stood in for: in-process Operations tests)."""
    import pyfuse3

    sent: list[tuple[bytes, int, int]] = []
    limit = {"n": None}

    def reply(token, name, attr, next_id):
        if limit["n"] is not None and len(sent) >= limit["n"]:
            return False
        sent.append((name, attr.st_ino, next_id))
        return True

    monkeypatch.setattr(pyfuse3, "readdir_reply", reply)
    return sent, limit


@pytest.fixture
def tensorio_isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """tensorio tests (pytestmark usefixtures): no selector dictionary on disk, no tool forced by
    the environment, a fresh default selector before and after (torch imported only here)."""
    from fanstore_fuse import tensorio as tio

    monkeypatch.setenv(tio.ENV_DB, "off")
    monkeypatch.delenv(tio.ENV_TOOL, raising=False)
    tio.set_default_selector(None)
    yield
    tio.set_default_selector(None)
