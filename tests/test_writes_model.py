"""WriteStore without FUSE: a hypothesis state machine against a dict-of-bytes model."""

from __future__ import annotations

import errno
import os
import shutil

from _writes_helpers import content, file_digests
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from fanstore_fuse._errors import FanstoreError
from fanstore_fuse.writes import (
    WriteStore,
    _hashing,
)

NAMES = ["a", "b", "d/a", "d/b", "d", "e"]


class WriteModel(RuleBasedStateMachine):
    """Random operation sequences against a dict-of-bytes model (files) and a set (dirs)."""

    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self.tmp = tempfile.mkdtemp()
        self.s = WriteStore(self.tmp)
        self.files: dict[str, bytes] = {}
        self.dirs: set[str] = {""}

    def teardown(self) -> None:
        self.s.close_store()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _parent_ok(self, p: str) -> int:
        parent = p.rpartition("/")[0]
        if parent in self.files:
            return errno.ENOTDIR
        if parent not in self.dirs:
            return errno.ENOENT
        return 0

    def _expect(self, fn, expected: int, *args) -> object:
        try:
            out = fn(*args)
        except FanstoreError as e:
            assert e.errno == expected, (fn.__name__, args, e.errno, expected)
            return None
        assert expected == 0, (fn.__name__, args, "succeeded, expected", expected)
        return out

    @rule(p=st.sampled_from(NAMES), data=st.binary(max_size=300))
    def create(self, p: str, data: bytes) -> None:
        err = self._parent_ok(p) or (errno.EEXIST if p in self.files or p in self.dirs else 0)
        out = self._expect(self.s.create, err, p)
        if out is not None:
            fh, _ = out
            self.s.write(fh, 0, data)
            self.s.close(fh)
            self.files[p] = data

    @rule(p=st.sampled_from(NAMES), off=st.integers(0, 400), data=st.binary(max_size=200))
    def write(self, p: str, off: int, data: bytes) -> None:
        err = self._parent_ok(p) or (0 if p in self.files else errno.EISDIR if p in self.dirs
                                     else errno.ENOENT)
        fh = self._expect(self.s.open, err, p, os.O_RDWR)
        if fh is not None:
            self.s.write(fh, off, data)
            self.s.close(fh)
            old = self.files[p]
            if data:
                old = old.ljust(off, b"\0")
                old = old[:off] + data + old[off + len(data):]
            self.files[p] = old

    @rule(p=st.sampled_from(NAMES),
          edits=st.lists(st.tuples(st.integers(0, 400), st.binary(max_size=100)), max_size=4))
    def edit(self, p: str, edits: list[tuple[int, bytes]]) -> None:
        """Several writes through one handle, then one commit at its close."""
        err = self._parent_ok(p) or (0 if p in self.files else errno.EISDIR if p in self.dirs
                                     else errno.ENOENT)
        fh = self._expect(self.s.open, err, p, os.O_RDWR)
        if fh is None:
            return
        new = self.files[p]
        for off, data in edits:
            self.s.write(fh, off, data)
            if data:
                new = new.ljust(off, b"\0")
                new = new[:off] + data + new[off + len(data):]
        self.s.close(fh)
        self.files[p] = new

    @rule(p=st.sampled_from(NAMES), size=st.integers(0, 500))
    def truncate(self, p: str, size: int) -> None:
        err = self._parent_ok(p) or (0 if p in self.files else errno.EISDIR if p in self.dirs
                                     else errno.ENOENT)
        if self._expect(self.s.truncate, err, p, size) is not None:
            self.files[p] = self.files[p][:size].ljust(size, b"\0")

    @rule(p=st.sampled_from(NAMES))
    def mkdir(self, p: str) -> None:
        err = self._parent_ok(p) or (errno.EEXIST if p in self.files or p in self.dirs else 0)
        if self._expect(self.s.mkdir, err, p) is not None:
            self.dirs.add(p)

    @rule(p=st.sampled_from(NAMES))
    def unlink(self, p: str) -> None:
        err = self._parent_ok(p) or (0 if p in self.files else errno.EISDIR if p in self.dirs
                                     else errno.ENOENT)
        self._expect(self.s.unlink, err, p)
        if err == 0:
            del self.files[p]

    @rule(p=st.sampled_from(NAMES))
    def rmdir(self, p: str) -> None:
        kids = [q for q in list(self.files) + list(self.dirs) if q.startswith(p + "/")]
        err = self._parent_ok(p) or (
            errno.ENOTDIR if p in self.files else errno.ENOENT if p not in self.dirs
            else errno.ENOTEMPTY if kids else 0)
        self._expect(self.s.rmdir, err, p)
        if err == 0:
            self.dirs.discard(p)

    @rule(a=st.sampled_from(NAMES), b=st.sampled_from(NAMES))
    def rename(self, a: str, b: str) -> None:
        err = self._parent_ok(a) or self._parent_ok(b)
        if not err and a not in self.files and a not in self.dirs:
            err = errno.ENOENT
        if not err and a in self.dirs and (b == a or b.startswith(a + "/")) and a != b:
            err = errno.EINVAL
        if not err and a != b:
            if a in self.dirs and b in self.files:
                err = errno.ENOTDIR
            elif a in self.files and b in self.dirs:
                err = errno.EISDIR
            elif b in self.dirs and any(q.startswith(b + "/") for q in list(self.files) + list(self.dirs)):
                err = errno.ENOTEMPTY
        self._expect(self.s.rename, err, a, b)
        if err or a == b:
            return
        if a in self.files:
            self.files[b] = self.files.pop(a)
        else:
            self.dirs.discard(b)
            moved = {q for q in self.dirs if q == a or q.startswith(a + "/")}
            self.dirs -= moved
            self.dirs |= {b + q[len(a):] for q in moved}
            for q in [q for q in self.files if q.startswith(a + "/")]:
                self.files[b + q[len(a):]] = self.files.pop(q)

    @rule()
    def reopen(self) -> None:
        self.s.close_store()
        self.s = WriteStore(self.tmp)
        assert self.s.warnings == []

    @invariant()
    def matches(self) -> None:
        for p, data in self.files.items():
            assert content(self.s, p) == data, p
            c = self.s.committed(p)
            assert (c.size, c.xxh3, c.chunks) == (len(data), *file_digests(data, _hashing.CHUNK))
        for d in self.dirs:
            names = {r.name.decode() for r in self.s.listdir(d)}
            prefix = d + "/" if d else ""
            expect = {q[len(prefix):] for q in list(self.files) + list(self.dirs)
                      if q != d and q.startswith(prefix) and "/" not in q[len(prefix):]}
            assert names == expect, (d, names, expect)
        assert self.s.status()["write_used_bytes"] == sum(map(len, self.files.values()))


WriteModel.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_model = WriteModel.TestCase


class SmallChunkModel(WriteModel):
    """The same with 64-byte chunks, so that files span many: a commit hashes again only the
    chunks changed since the last one (writes in place, past the end, truncates), and its
    chunk digests and file digest must still be those of the whole file."""

    def __init__(self) -> None:
        self._chunk = _hashing.CHUNK
        _hashing.CHUNK = 64
        super().__init__()

    def teardown(self) -> None:
        super().teardown()
        _hashing.CHUNK = self._chunk


SmallChunkModel.TestCase.settings = WriteModel.TestCase.settings
test_model_small_chunks = SmallChunkModel.TestCase
