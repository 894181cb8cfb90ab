"""tensorio: byte-exact round trips through every tool, corruption detection, the selector's
decisions with injected timings, persistence, and feature-map offload gradients."""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from fanstore_fuse import tensorio as tio  # noqa: E402
from fanstore_fuse.tensorio import _format as fmt  # noqa: E402

pytestmark = [pytest.mark.tensor, pytest.mark.timeout(120)]


@pytest.fixture(autouse=True)
def _isolated_selector(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(tio.ENV_DB, "off")
    monkeypatch.delenv(tio.ENV_TOOL, raising=False)
    tio.set_default_selector(None)
    yield
    tio.set_default_selector(None)


def _sample() -> collections.OrderedDict:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    sd = collections.OrderedDict()
    sd["f32"] = torch.randn(3, 5, generator=g)
    sd["bf16"] = torch.randn(70, 33, generator=g).to(torch.bfloat16)
    sd["f16"] = torch.randn(17, generator=g).half()
    sd["f64"] = torch.randn(2, 2, dtype=torch.float64, generator=g)
    sd["i8"] = torch.randint(-128, 127, (40,), dtype=torch.int8, generator=g)
    sd["u8"] = torch.randint(0, 255, (9, 3), dtype=torch.uint8, generator=g)
    sd["i64"] = torch.arange(-5, 5)
    sd["bool"] = torch.rand(13, generator=g) > 0.5
    sd["scalar"] = torch.tensor(3.25)
    sd["scalar_i"] = torch.tensor(-7, dtype=torch.int32)
    sd["noncontig"] = base.t()
    sd["strided"] = base[::2, 1::3]
    sd["shared_a"] = base[1]
    sd["shared_b"] = base[1:3]
    sd["empty"] = torch.empty(0, 4)
    sd["c64"] = torch.randn(4, dtype=torch.complex64, generator=g)
    sd["big"] = torch.randn(40_000, generator=g)  # > 64 KiB: 4 KiB aligned, 2 pieces? no, 1
    sd["param"] = torch.nn.Parameter(torch.ones(3))
    sd["nested"] = {
        "list": [torch.zeros(2, dtype=torch.int16), 1, 2.5, "x", None, True],
        "tuple": (torch.full((2, 2), 7.0), (1, 2)),
        3: {"deep": [[torch.tensor([1, 2], dtype=torch.int8)]]},
        "bytes": b"\x00\xff",
        "size": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "inf": float("inf"),
    }
    sd._metadata = {"": {"version": 2}}  # type: ignore[attr-defined]
    return sd


def _leaves(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _leaves(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _leaves(v)


def _assert_same(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan()))
        if a.numel():
            ab = a.detach().contiguous().reshape(-1)
            bb = b.detach().contiguous().reshape(-1)
            if a.is_complex():
                ab, bb = torch.view_as_real(ab), torch.view_as_real(bb)
            assert torch.equal(ab.view(torch.uint8), bb.view(torch.uint8))  # byte-exact
        assert isinstance(b, torch.nn.Parameter) == isinstance(a, torch.nn.Parameter)
        assert a.requires_grad == b.requires_grad
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys())
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


WRITE_TOOLS = [n for n, t in tio.tools().items() if "write" in t.ops and "cpu" in t.devices]
READ_TOOLS = [n for n, t in tio.tools().items() if "read" in t.ops and "cpu" in t.devices]


def test_registry_has_cpu_tools_and_gpu_tools_only_with_cuda():
    names = set(tio.tools())
    assert {"pread", "odirect", "mmap", "torch", "safetensors"} <= names
    gpu = {"pinned-stream", "kvikio", "gds"} & names
    if not torch.cuda.is_available():
        assert not gpu
    for t in tio.tools().values():
        assert isinstance(t, tio.Tool)


@pytest.mark.parametrize("writer", WRITE_TOOLS)
def test_round_trip_every_writer_every_reader(tmp_path: Path, writer: str):
    sd = _sample()
    p = tmp_path / "sd.fst"
    assert tio.save(sd, p, tool=writer) == writer
    assert p.stat().st_size % 4096 == 0
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]
    for reader in READ_TOOLS:
        out = tio.load(p, tool=reader)
        _assert_same(sd, out)
        assert out._metadata == {"": {"version": 2}}


def test_every_writer_produces_the_same_bytes(tmp_path: Path):
    sd = _sample()
    blobs = {}
    for w in WRITE_TOOLS:
        tio.save(sd, tmp_path / f"{w}.fst", tool=w)
        blobs[w] = (tmp_path / f"{w}.fst").read_bytes()
    assert len(set(blobs.values())) == 1, "one format for every tool"


def test_layout_alignment_and_safetensors_compat(tmp_path: Path):
    from safetensors.torch import load_file

    sd = _sample()
    p = tmp_path / "a.fst"
    tio.save(sd, p)
    lay = tio.read_layout(p)
    assert lay.data_offset % 4096 == 0 and lay.data_len % 4096 == 0
    for e in lay.entries:
        assert e.offset % (4096 if e.nbytes >= fmt.BIG_TENSOR else 64) == 0
    raw = load_file(str(p))  # the same file is a valid safetensors file
    flat = list(_leaves(sd))
    assert torch.equal(raw["t0"], flat[0])
    assert torch.equal(raw["t1"], flat[1])  # bf16 declared as BF16


def test_single_tensor_and_plain_values(tmp_path: Path):
    for obj in [torch.arange(5), torch.tensor(True), [1, "a", None], {"k": (1.5, -2)}, 7]:
        tio.save(obj, tmp_path / "x.fst")
        _assert_same(obj, tio.load(tmp_path / "x.fst"))


def test_multi_piece_tensor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(fmt, "PIECE", 64 << 10)
    t = torch.randn(100_000)  # 400 KB: 7 pieces
    tio.save({"t": t}, tmp_path / "m.fst")
    lay = tio.read_layout(tmp_path / "m.fst")
    assert len(lay.entries[0].hashes) == 7
    for r in READ_TOOLS:
        assert torch.equal(tio.load(tmp_path / "m.fst", tool=r)["t"], t)


def test_rejects_unsupported_values(tmp_path: Path):
    with pytest.raises(TypeError):
        tio.save({"x": object()}, tmp_path / "bad.fst")
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------- corruption


def _flip(p: Path, off: int) -> None:
    with open(p, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("where", ["length", "magic", "digest", "index", "padding"])
def test_corrupt_header_detected(tmp_path: Path, where: str):
    p = tmp_path / "c.fst"
    tio.save(_sample(), p)
    raw = p.read_bytes()
    body_end = raw.index(b"}", raw.rindex(b'"data_offsets"')) + 2
    off = {
        "length": 1,
        "magic": 10,
        "digest": raw.index(b'"xxh3":"') + 9,
        "index": raw.index(b"float32"),
        "padding": body_end + 5,
    }[where]
    _flip(p, off)
    with pytest.raises((tio.TensorChecksumError, tio.TensorFormatError)):
        tio.load(p)


@pytest.mark.parametrize("reader", READ_TOOLS)
def test_corrupt_data_detected_by_every_reader(tmp_path: Path, reader: str):
    p = tmp_path / "c.fst"
    sd = _sample()
    tio.save(sd, p)
    lay = tio.read_layout(p)
    for e in (lay.entries[0], lay.entries[-1]):
        q = tmp_path / "c2.fst"
        q.write_bytes(p.read_bytes())
        _flip(q, lay.data_offset + e.offset + e.nbytes - 1)
        with pytest.raises(tio.TensorChecksumError):
            tio.load(q, tool=reader)


def test_truncated_and_foreign_files(tmp_path: Path):
    p = tmp_path / "t.fst"
    tio.save(_sample(), p)
    data = p.read_bytes()
    (tmp_path / "short.fst").write_bytes(data[:-4096])
    with pytest.raises(tio.TensorFormatError):
        tio.load(tmp_path / "short.fst")
    torch.save({"a": torch.ones(2)}, tmp_path / "x.pt")
    with pytest.raises(tio.TensorFormatError):
        tio.load(tmp_path / "x.pt")
    (tmp_path / "tiny").write_bytes(b"abc")
    with pytest.raises(tio.TensorFormatError):
        tio.load(tmp_path / "tiny")


def test_unknown_version_rejected(tmp_path: Path):
    p = tmp_path / "v.fst"
    tio.save({"a": torch.ones(2)}, p)
    raw = bytearray(p.read_bytes())
    i = raw.index(b'"fstio":"1"') + 9
    raw[i : i + 1] = b"9"
    m = fmt._HDR_RE.match(raw, 8)
    n = 8 + int.from_bytes(raw[:8], "little")
    hdr = bytearray(raw[:n])
    hdr[m.start(2) : m.end(2)] = b"0" * 16
    raw[m.start(2) : m.end(2)] = f"{fmt.xxh3(hdr):016x}".encode()
    p.write_bytes(bytes(raw))
    with pytest.raises(tio.TensorFormatError, match="version 9"):
        tio.load(p)


def test_verify_false_skips_data_check_but_not_header(tmp_path: Path):
    p = tmp_path / "c.fst"
    tio.save({"a": torch.ones(4)}, p)
    lay = tio.read_layout(p)
    _flip(p, lay.data_offset)
    assert not torch.equal(tio.load(p, verify=False)["a"], torch.ones(4))
    with pytest.raises(tio.TensorChecksumError):
        tio.load(p)


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


# ------------------------------------------------------------------------- offload


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, padding=1),
        torch.nn.Tanh(),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 16 * 16, 10),
    )


def _grads(offload_dir: Path | None):
    m = _model()
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    if offload_dir is None:
        loss = m(x).square().sum()
        loss.backward()
        stats = None
    else:
        with tio.offload(offload_dir, threshold=4096, prefetch=2) as off:
            loss = m(x).square().sum()
            loss.backward()
        stats = off.stats
    return loss.detach(), [p.grad.clone() for p in m.parameters()], stats


def test_offload_gives_identical_gradients(tmp_path: Path):
    loss0, g0, _ = _grads(None)
    loss1, g1, stats = _grads(tmp_path)
    assert stats["offloaded"] >= 3 and stats["kept"] >= 1
    assert stats["prefetch_hits"] >= 1
    assert torch.equal(loss0, loss1)
    for a, b in zip(g0, g1, strict=True):
        assert torch.equal(a, b)
    assert os.listdir(tmp_path) == []  # files and directory removed on exit


def test_offload_with_forced_tools(tmp_path: Path):
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
    x = torch.randn(32, 64)
    m(x).sum().backward()
    want = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    with tio.offload(tmp_path, threshold=1024, tool_write="mmap", tool_read="odirect") as off:
        m(x).sum().backward()
    assert off.stats["offloaded"] >= 2
    for a, p in zip(want, m.parameters(), strict=True):
        assert torch.equal(a, p.grad)


def test_load_mmap_zero_copy(tmp_path: Path):
    sd = _sample()
    p = tmp_path / "z.fst"
    tio.save(sd, p)
    out = tio.load(p, mmap=True)
    _assert_same(sd, out)
    before = p.read_bytes()
    out["f32"].add_(1)  # copy-on-write: the file never changes
    assert p.read_bytes() == before
    tio.save({"a": torch.ones(3)}, p)  # replaced by rename: mapped tensors keep old bytes
    _assert_same(sd["i8"], out["i8"])
    lay = tio.read_layout(p)
    _flip(p, lay.data_offset + 1)
    with pytest.raises(tio.TensorChecksumError):
        tio.load(p, mmap=True)


def test_random_shapes_and_dtypes_round_trip(tmp_path: Path):
    hyp = pytest.importorskip("hypothesis")
    st = pytest.importorskip("hypothesis.strategies")
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.bool,
              torch.int64, torch.float64]

    @hyp.settings(max_examples=10, deadline=None, database=None)
    @hyp.given(
        specs=st.lists(
            st.tuples(st.sampled_from(dtypes), st.lists(st.integers(0, 40), max_size=3),
                      st.booleans()),
            max_size=6,
        ),
        seed=st.integers(0, 2**31 - 1),
    )
    def run(specs, seed):
        g = torch.Generator().manual_seed(seed)
        ts = []
        for dt, shape, transpose in specs:
            t = (torch.rand(shape, generator=g) * 100 - 50).to(dt)
            if transpose and t.dim() >= 2:
                t = t.transpose(0, 1)
            ts.append(t)
        p = tmp_path / "h.fst"
        tio.save(ts, p, tool="pread")
        _assert_same(ts, tio.load(p, tool="pread"))

    run()


@pytest.mark.parametrize(
    "entry",
    [
        fmt.Entry(torch.float32, (4,), 8192, 16, (0,)),  # past the data region
        fmt.Entry(torch.float32, (4,), 0, 12, (0,)),  # nbytes disagrees with shape
        fmt.Entry(torch.float32, (4,), 0, 16, ()),  # missing piece hash
        fmt.Entry(torch.float32, (4,), 3, 16, (0,)),  # misaligned
    ],
)
def test_consistent_checksum_but_inconsistent_header_refused(tmp_path: Path, entry):
    header = fmt.encode_header({"t": 0}, [entry], 4096)
    p = tmp_path / "crafted.fst"
    p.write_bytes(header + bytes(4096))
    with pytest.raises(tio.TensorFormatError):
        tio.load(p)


def test_host_buffers_are_recycled_and_overwritten(tmp_path: Path):
    import gc

    from fanstore_fuse.tensorio import _hostbuf

    gc.collect()
    _hostbuf.clear_cache()
    a = {"x": torch.randn(1 << 20)}  # 4 MiB
    b = {"x": torch.randn(1 << 20)}
    tio.save(a, tmp_path / "a.fst")
    tio.save(b, tmp_path / "b.fst")
    out = tio.load(tmp_path / "a.fst")
    keep = out["x"][:3]
    del out
    gc.collect()
    assert _hostbuf.cached_bytes() == 0  # a view is alive: nothing recycled
    del keep
    gc.collect()
    assert _hostbuf.cached_bytes() > 0
    again = tio.load(tmp_path / "b.fst")  # reuses the buffer; every byte rewritten
    assert _hostbuf.cached_bytes() == 0
    assert torch.equal(again["x"], b["x"])
    _hostbuf.clear_cache()


def test_forced_calls_are_not_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    p = tmp_path / "f.fst"
    sel = tio.Selector(stamp={})
    tio.save({"a": torch.ones(3)}, p, tool="pread", selector=sel)
    tio.load(p, tool="mmap", selector=sel)
    monkeypatch.setenv(tio.ENV_TOOL, "torch")
    tio.load(p, selector=sel)
    assert all(not e["samples"] for e in sel.entries.values())


def test_offload_creates_its_directory_and_cleans_up(tmp_path: Path):
    target = tmp_path / "not" / "yet"
    loss0, g0, _ = _grads(None)
    loss1, g1, stats = _grads(target)
    assert stats["offloaded"] >= 1
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert target.is_dir() and not any(target.iterdir())
