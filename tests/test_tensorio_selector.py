"""tensorio's selector: its decisions with injected timings, a failing tool dropped with the old
file kept, persistence of its dictionary, the file system type and page-cache residency."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from fanstore_fuse import tensorio as tio  # noqa: E402

pytestmark = [pytest.mark.tensor, pytest.mark.timeout(120), pytest.mark.usefixtures("tensorio_isolated")]


# ------------------------------------------------------------------------- atomic writes


class _Boom:
    name = "boom"
    ops = frozenset({"write"})
    devices = frozenset({"cpu"})

    def probe(self, op, device, path):
        return op == "write"

    def read_into(self, path, layout, dest, on_chunk):  # pragma: no cover
        raise AssertionError

    def write(self, path, layout, sources):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(5, "disk on fire")


def test_failed_write_leaves_old_file_and_no_temp(tmp_path: Path):
    p = tmp_path / "keep.fst"
    tio.save({"a": torch.ones(2)}, p)
    before = p.read_bytes()
    tio.register(_Boom())
    try:
        with pytest.raises(OSError, match="disk on fire"):
            tio.save({"a": torch.zeros(2)}, p, tool="boom")
        assert p.read_bytes() == before
        assert sorted(os.listdir(tmp_path)) == ["keep.fst"]
        # unforced: the selector falls back to a working tool and remembers the failure
        sel = tio.Selector(stamp={}, clock=iter(range(1000)).__next__)
        names = tio.eligible("write", "cpu", str(p))
        assert "boom" in names
        sel.entries[_write_key(p)] = {**_fresh(), "eligible": names,
                                      "samples": {n: [1.0] for n in names if n != "boom"}}
        used = tio.save({"a": torch.zeros(2)}, p, selector=sel)
        assert used != "boom"
        assert "boom" in sel.entries[_write_key(p)]["dropped"]
        assert torch.equal(tio.load(p)["a"], torch.zeros(2))
        assert sorted(os.listdir(tmp_path)) == ["keep.fst"]
    finally:
        tio.unregister("boom")


def _fresh():
    from fanstore_fuse.tensorio._selector import _fresh

    return _fresh()


def _write_key(p: Path) -> str:
    return tio.make_key("write", "cpu", 4096, "-", tio.fs_type(p.parent))


# ------------------------------------------------------------------------- selector


def _drive(sel: tio.Selector, key: str, times: dict[str, float], calls: int, nbytes: int = 1000):
    picks = []
    for _ in range(calls):
        t = sel.choose(key, list(times))
        picks.append(t)
        sel.record(key, t, times[t], nbytes)
    return picks


def test_selector_explores_drops_and_commits():
    sel = tio.Selector(stamp={}, explore_rounds=2, drop_factor=2.0)
    key = tio.make_key("read", "cpu", 100 << 20, "warm", "ext4")
    times = {"a": 1.0, "b": 0.5, "c": 5.0, "d": 0.6}
    picks = _drive(sel, key, times, 12)
    # round one: each tool once (in order); c is >2x slower than b and is dropped at once
    assert picks[:4] == ["a", "b", "c", "d"]
    assert sel.entries[key]["dropped"] == ["c"]
    assert picks[4:7] == ["a", "b", "d"]
    assert sel.decision(key) == "b"
    assert set(picks[7:]) == {"b"}


def test_selector_is_per_key_and_uses_buckets():
    assert tio.size_bucket(1) == 0 and tio.size_bucket(4096) == 12 and tio.size_bucket(4097) == 13
    assert tio.make_key("read", "cpu", 3000, "warm", "ext4") == tio.make_key(
        "read", "cpu", 4000, "warm", "ext4"
    )
    sel = tio.Selector(stamp={})
    small = tio.make_key("read", "cpu", 4 << 10, "warm", "ext4")
    big = tio.make_key("read", "cpu", 1 << 30, "warm", "ext4")
    _drive(sel, small, {"mmap": 1.0, "pread": 2.0}, 6)
    _drive(sel, big, {"mmap": 2.0, "pread": 1.0}, 6)
    assert sel.decision(small) == "mmap" and sel.decision(big) == "pread"


def test_selector_compares_per_byte_within_a_bucket():
    sel = tio.Selector(stamp={}, explore_rounds=1)
    key = "k"
    sel.choose(key, ["a", "b"])
    sel.record(key, "a", 1.0, 1000)  # 1 ms/KB
    sel.choose(key, ["a", "b"])
    sel.record(key, "b", 1.5, 2000)  # 0.75 ms/KB: faster although the call took longer
    assert sel.decision(key) == "b"


def test_selector_reexplores_when_committed_tool_slows_down():
    sel = tio.Selector(stamp={}, explore_rounds=1, slow_factor=1.5, patience=3)
    key = "k"
    times = {"a": 1.0, "b": 2.0}
    _drive(sel, key, times, 2)
    assert sel.decision(key) == "a"
    times["a"] = 1.4  # within 1.5x: stays
    _drive(sel, key, times, 5)
    assert sel.decision(key) == "a"
    times["a"] = 4.0
    picks = _drive(sel, key, times, 2)
    assert picks == ["a", "a"] and sel.decision(key) == "a"
    picks = _drive(sel, key, times, 1)  # third slow call in a row: explore again
    assert sel.decision(key) is None
    picks = _drive(sel, key, times, 2)
    assert picks == ["a", "b"] and sel.decision(key) == "b"


def test_selector_periodic_reexplore():
    sel = tio.Selector(stamp={}, explore_rounds=1, reexplore_every=4)
    _drive(sel, "k", {"a": 1.0, "b": 2.0}, 2)
    _drive(sel, "k", {"a": 1.0, "b": 2.0}, 4)
    assert sel.decision("k") is None


def test_selector_override_argument_and_env(monkeypatch: pytest.MonkeyPatch):
    sel = tio.Selector(stamp={}, explore_rounds=1)
    _drive(sel, "k", {"a": 1.0, "b": 2.0}, 2)
    assert sel.choose("k", ["a", "b"], override="b") == "b"
    monkeypatch.setenv(tio.ENV_TOOL, "b")
    assert sel.choose("k", ["a", "b"]) == "b"
    with pytest.raises(ValueError):
        sel.choose("k", ["a"], override="zzz")
    sel.record("k", "b", 99.0, 1)  # a forced call does not disturb the decision
    assert sel.decision("k") == "a"


def test_load_uses_selector_with_injected_clock(tmp_path: Path):
    """End to end: fake per-tool durations through an injected clock decide the tool."""
    p = tmp_path / "s.fst"
    tio.save({"w": torch.randn(64, 64)}, p)
    fake = {"pread": 3.0, "odirect": 5.0, "mmap": 1.0, "torch": 2.0, "safetensors": 9.0}
    state = {"t": 0.0, "phase": 0}

    def clock() -> float:  # called once before and once after each tool call
        state["phase"] ^= 1
        if state["phase"] == 0:
            state["t"] += fake[sel.last_choice]
        return state["t"]

    sel = tio.Selector(stamp={}, clock=clock, explore_rounds=2)
    used = []
    for _ in range(12):
        tio.load(p, selector=sel)
        used.append(sel.last_choice)
    names = tio.eligible("read", "cpu", str(p))
    key = next(iter(sel.entries))
    assert key.startswith("read|cpu|b")
    assert sel.decision(key) == "mmap"
    assert used[-3:] == ["mmap"] * 3
    assert set(sel.entries[key]["dropped"]) == {n for n in names if fake[n] > 2 * 1.0}


def test_persisted_dictionary_round_trip_and_stamp_mismatch(tmp_path: Path):
    db = tmp_path / "sel.json"
    stamp = tio.machine_stamp()
    assert stamp["host"] and stamp["cpu"] and stamp["versions"]["torch"] == torch.__version__
    sel = tio.Selector(db, stamp=stamp, explore_rounds=1)
    _drive(sel, "k", {"a": 1.0, "b": 2.0}, 2)
    data = json.loads(db.read_text())
    assert data["stamp"] == stamp and data["entries"]["k"]["choice"] == "a"
    again = tio.Selector(db, stamp=stamp)
    assert again.decision("k") == "a"
    other = dict(stamp, versions={**stamp["versions"], "torch": "0.0.1"})
    fresh = tio.Selector(db, stamp=other)
    assert fresh.decision("k") is None and fresh.entries == {}
    db.write_text("{not json")
    assert tio.Selector(db, stamp=stamp).entries == {}


def test_default_selector_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    db = tmp_path / "d.json"
    monkeypatch.setenv(tio.ENV_DB, str(db))
    tio.set_default_selector(None)
    assert tio.default_selector().path == str(db)


def test_fs_type_and_residency(tmp_path: Path):
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "/dev/vda / ext4 rw 0 0\n"
        f"fanstore {tmp_path}/mnt fuse.fanstore rw 0 0\n"
        f"tmpfs {tmp_path}/mnt/x\\040y tmpfs rw 0 0\n"
    )
    from fanstore_fuse.tensorio._fs import fs_type

    assert fs_type(tmp_path / "mnt" / "a" / "b", str(mounts)) == "fuse.fanstore"
    assert fs_type(tmp_path / "mnt" / "x y" / "f", str(mounts)) == "tmpfs"
    assert fs_type(tmp_path / "mntx", str(mounts)) == "ext4"
    p = tmp_path / "r.fst"
    tio.save({"a": torch.randn(100_000)}, p)
    assert tio.cache_state(p) == "warm"
    tio.drop_cache(p)
    assert 0.0 <= tio.residency(p) <= 1.0  # eviction is best effort on some file systems


def test_forced_calls_are_not_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    p = tmp_path / "f.fst"
    sel = tio.Selector(stamp={})
    tio.save({"a": torch.ones(3)}, p, tool="pread", selector=sel)
    tio.load(p, tool="mmap", selector=sel)
    monkeypatch.setenv(tio.ENV_TOOL, "torch")
    tio.load(p, selector=sel)
    assert all(not e["samples"] for e in sel.entries.values())
