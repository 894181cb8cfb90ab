"""tensorio's file format: byte-exact round trips through every tool, the layout, corruption
detection, zero-copy loads, crafted headers, recycled host buffers (the selector:
test_tensorio_selector.py; offload: test_tensorio_offload.py)."""

from __future__ import annotations

import collections
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from fanstore_fuse import tensorio as tio  # noqa: E402
from fanstore_fuse.tensorio import _format as fmt  # noqa: E402

pytestmark = [pytest.mark.tensor, pytest.mark.timeout(120), pytest.mark.usefixtures("tensorio_isolated")]


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
