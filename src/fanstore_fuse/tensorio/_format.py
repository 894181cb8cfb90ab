"""The one tensorio file format, shared by every transfer tool.

Layout of a file (all integers little-endian)::

    [u64 N][N bytes of JSON header, padded with spaces][data region]

* ``8 + N`` is a multiple of 4096, so the data region starts 4 KiB-aligned; its length is a
  multiple of 4096 too (zero padding at the end), so O_DIRECT can read it in whole blocks.
* The header is a valid safetensors header: one entry per tensor (``t0``, ``t1``...) and one
  ``U8`` entry per padding gap (``p0``...), so ``safetensors`` reads the very same file.
* ``__metadata__`` starts with the fixed bytes ``{"__metadata__":{"fstio":"<version>",
  "xxh3":"<16 hex>"`` (the magic, at offset 8). ``xxh3`` is the xxh3-64 (seed ``XXH_SEED``) of
  the whole ``8 + N`` header bytes with those 16 hex digits replaced by ``0``.
* ``index`` (a JSON string inside the metadata) holds the object tree, each tensor's dtype,
  shape, offset and byte length, and the xxh3-64 of each ``piece``-sized slice of its bytes.
* Tensors of at least ``BIG_TENSOR`` bytes start 4096-aligned in the data region, smaller ones
  64-aligned; gaps are zero.
"""

from __future__ import annotations

import base64
import collections
import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from ._errors import TensorChecksumError, TensorFormatError

VERSION = 1
XXH_SEED = 0x46535449  # "FSTI"
PAGE = 4096
SMALL_ALIGN = 64
BIG_TENSOR = 64 * 1024
PIECE = 4 << 20  # hash granularity inside a tensor
CHUNK = 8 << 20  # target I/O chunk
MAX_HEADER = 256 << 20
MAGIC = b'{"__metadata__":{"fstio":"'
_HDR_RE = re.compile(rb'\{"__metadata__":\{"fstio":"(\d+)","xxh3":"([0-9a-f]{16})"')

# torch dtype -> (our name, safetensors name or None when safetensors lacks it)
_DTYPES: dict[torch.dtype, tuple[str, str | None]] = {
    torch.float64: ("float64", "F64"),
    torch.float32: ("float32", "F32"),
    torch.float16: ("float16", "F16"),
    torch.bfloat16: ("bfloat16", "BF16"),
    torch.int64: ("int64", "I64"),
    torch.int32: ("int32", "I32"),
    torch.int16: ("int16", "I16"),
    torch.int8: ("int8", "I8"),
    torch.uint8: ("uint8", "U8"),
    torch.bool: ("bool", "BOOL"),
    torch.complex64: ("complex64", None),
    torch.complex128: ("complex128", None),
}
for _n, _st in (
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
):
    if hasattr(torch, _n):
        _DTYPES[getattr(torch, _n)] = (_n, _st)
_BY_NAME = {name: dt for dt, (name, _) in _DTYPES.items()}


def xxh3(data: Any) -> int:
    return xxhash.xxh3_64_intdigest(data, seed=XXH_SEED)


def align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Entry:
    """One tensor in the data region."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # in the data region
    nbytes: int
    hashes: tuple[int, ...] = ()  # xxh3 of each PIECE of the tensor's bytes
    param: bool = False
    requires_grad: bool = False

    def pieces(self, piece: int) -> list[tuple[int, int]]:
        """(data offset, length) of each hashed piece; one empty piece for an empty tensor."""
        if self.nbytes == 0:
            return [(self.offset, 0)]
        return [
            (self.offset + p, min(piece, self.nbytes - p)) for p in range(0, self.nbytes, piece)
        ]


@dataclass(frozen=True)
class Chunk:
    """A 4096-aligned range of the data region and the hashed pieces wholly inside it."""

    start: int
    end: int
    pieces: tuple[tuple[int, int, int, int], ...]  # (tensor index, piece index, offset, length)

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class Layout:
    """Everything a tool needs: where each tensor lives, how to rebuild the tree."""

    tree: Any
    entries: list[Entry]
    data_offset: int
    data_len: int
    piece: int = PIECE
    header: bytes = b""
    _chunks: dict[int, list[Chunk]] = field(default_factory=dict, repr=False)

    @property
    def file_size(self) -> int:
        return self.data_offset + self.data_len

    def chunks(self, target: int | None = None) -> list[Chunk]:
        """Split the data region into ~target-sized chunks on 4096-aligned piece boundaries."""
        target = target or CHUNK
        if target in self._chunks:
            return self._chunks[target]
        out: list[Chunk] = []
        start = 0
        cur: list[tuple[int, int, int, int]] = []
        for ti, e in enumerate(self.entries):
            for pi, (off, ln) in enumerate(e.pieces(self.piece)):
                if off - start >= target and off % PAGE == 0:
                    out.append(Chunk(start, off, tuple(cur)))
                    start, cur = off, []
                cur.append((ti, pi, off, ln))
        if self.data_len > start or cur:
            out.append(Chunk(start, self.data_len, tuple(cur)))
        self._chunks[target] = out
        return out

    def gather(self, sources: Sequence[memoryview], start: int, end: int) -> list[memoryview]:
        """Buffers that together are exactly the data bytes [start, end) (zeros in gaps)."""
        bufs: list[memoryview] = []
        pos = start
        for e, src in zip(self.entries, sources, strict=True):
            if e.offset + e.nbytes <= pos or e.nbytes == 0:
                continue
            if e.offset >= end:
                break
            if e.offset > pos:
                bufs.extend(_zeros(e.offset - pos))
                pos = e.offset
            hi = min(end, e.offset + e.nbytes)
            bufs.append(src[pos - e.offset : hi - e.offset])
            pos = hi
        if pos < end:
            bufs.extend(_zeros(end - pos))
        return bufs


_ZERO = memoryview(bytearray(1 << 20))  # writable so torch.frombuffer does not warn; never written


def _zeros(n: int) -> list[memoryview]:
    return [_ZERO[: min(n - i, len(_ZERO))] for i in range(0, n, len(_ZERO))]


# ----------------------------------------------------------------------------- object tree


class _Flattener:
    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []

    def enc(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            self.tensors.append(x)
            return {"t": len(self.tensors) - 1}
        if x is None or isinstance(x, (bool, int, str)):
            return x
        if isinstance(x, float):
            return x if math.isfinite(x) else {"f": repr(x)}
        if isinstance(x, torch.Size):
            return {"S": list(x)}
        if isinstance(x, torch.dtype):
            return {"D": str(x).removeprefix("torch.")}
        if isinstance(x, (bytes, bytearray)):
            return {"b": base64.b64encode(bytes(x)).decode()}
        if isinstance(x, dict):
            items = [[self.enc(k), self.enc(v)] for k, v in x.items()]
            if isinstance(x, collections.OrderedDict):
                out: dict[str, Any] = {"o": items}
                meta = getattr(x, "_metadata", None)
                if meta is not None:
                    out["m"] = self.enc(meta)
                return out
            return {"d": items}
        if isinstance(x, tuple):
            return {"u": [self.enc(v) for v in x]}
        if isinstance(x, list):
            return {"l": [self.enc(v) for v in x]}
        raise TypeError(f"tensorio cannot save a value of type {type(x).__name__}")


def flatten(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    """Encode obj as a JSON-able tree; tensors become {"t": index}."""
    f = _Flattener()
    return f.enc(obj), f.tensors


def _key(x: Any) -> Any:
    return tuple(_key(v) for v in x) if isinstance(x, list) else x


def unflatten(tree: Any, tensors: Sequence[torch.Tensor]) -> Any:
    def dec(x: Any) -> Any:
        if not isinstance(x, dict):
            return x
        ((tag, v),) = ((k, x[k]) for k in x if k != "m")
        if tag == "t":
            return tensors[v]
        if tag in ("d", "o"):
            cls = collections.OrderedDict if tag == "o" else dict
            d = cls((_hashable(dec(k)), dec(val)) for k, val in v)
            if "m" in x:
                d._metadata = dec(x["m"])  # type: ignore[attr-defined]
            return d
        if tag == "l":
            return [dec(e) for e in v]
        if tag == "u":
            return tuple(dec(e) for e in v)
        if tag == "S":
            return torch.Size(v)
        if tag == "D":
            return getattr(torch, v)
        if tag == "b":
            return base64.b64decode(v)
        if tag == "f":
            return float(v)
        raise TensorFormatError(f"unknown tree tag {tag!r}")

    return dec(tree)


def _hashable(k: Any) -> Any:
    return tuple(_hashable(e) for e in k) if isinstance(k, list) else k


# ----------------------------------------------------------------------------- tensors <-> bytes


def host_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's logical bytes as a contiguous 1-D uint8 CPU tensor (a view when possible)."""
    t = t.detach()
    if t.is_sparse or t.layout != torch.strided:
        raise TypeError("tensorio saves strided (dense) tensors only")
    if t.is_quantized:
        raise TypeError("tensorio does not save quantized tensors")
    if t.dtype not in _DTYPES:
        raise TypeError(f"tensorio does not support dtype {t.dtype}")
    t = t.resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.is_complex():
        t = torch.view_as_real(t).reshape(-1)
    return t.view(torch.uint8)


def plan(tensors: Sequence[torch.Tensor]) -> tuple[list[Entry], int]:
    """Offsets for each tensor; returns entries (without hashes) and the padded data length."""
    entries = []
    pos = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        pos = align(pos, PAGE if n >= BIG_TENSOR else SMALL_ALIGN)
        entries.append(
            Entry(
                dtype=t.dtype,
                shape=tuple(t.shape),
                offset=pos,
                nbytes=n,
                param=isinstance(t, torch.nn.Parameter),
                requires_grad=bool(t.requires_grad),
            )
        )
        pos += n
    return entries, align(pos, PAGE)


def view_tensor(buf: torch.Tensor, e: Entry) -> torch.Tensor:
    """Rebuild one tensor as a view of the data-region buffer."""
    raw = buf[e.offset : e.offset + e.nbytes]
    if e.dtype.is_complex:
        real = torch.float32 if e.dtype == torch.complex64 else torch.float64
        t = torch.view_as_complex(raw.view(real).view(*e.shape, 2))
    else:
        t = raw.view(e.dtype).view(e.shape)
    if e.param:
        return torch.nn.Parameter(t, requires_grad=e.requires_grad)
    return t


# ----------------------------------------------------------------------------- header


def encode_header(tree: Any, entries: Sequence[Entry], data_len: int, piece: int = PIECE) -> bytes:
    """The full header block (u64 length + padded JSON), data_offset = len(result)."""
    index = {
        "tree": tree,
        "data_len": data_len,
        "piece": piece,
        "tensors": [
            {
                "dtype": _DTYPES[e.dtype][0],
                "shape": list(e.shape),
                "offset": e.offset,
                "nbytes": e.nbytes,
                "xxh3": [f"{h:016x}" for h in e.hashes],
                **({"param": True, "requires_grad": e.requires_grad} if e.param else {}),
            }
            for e in entries
        ],
    }
    meta = json.dumps(
        {"fstio": str(VERSION), "xxh3": "0" * 16, "index": json.dumps(index, separators=(",", ":"))},
        separators=(",", ":"),
    )
    parts = ['{"__metadata__":', meta]
    pos = 0
    npad = 0

    def pad(upto: int) -> None:
        nonlocal pos, npad
        if upto > pos:
            parts.append(f',"p{npad}":{{"dtype":"U8","shape":[{upto - pos}],')
            parts.append(f'"data_offsets":[{pos},{upto}]}}')
            npad += 1
            pos = upto

    for i, e in enumerate(entries):
        pad(e.offset)
        st = _DTYPES[e.dtype][1]
        shape = list(e.shape) if st is not None else [e.nbytes]
        parts.append(
            f',"t{i}":{{"dtype":"{st or "U8"}","shape":{json.dumps(shape)},'
            f'"data_offsets":[{e.offset},{e.offset + e.nbytes}]}}'
        )
        pos = e.offset + e.nbytes
    pad(data_len)
    parts.append("}")
    body = "".join(parts).encode()
    total = align(8 + len(body), PAGE)
    raw = bytearray((total - 8).to_bytes(8, "little") + body + b" " * (total - 8 - len(body)))
    m = _HDR_RE.match(raw, 8)
    assert m is not None
    digest = f"{xxh3(raw):016x}".encode()
    raw[m.start(2) : m.end(2)] = digest
    return bytes(raw)


def parse_header(raw: bytes, file_size: int | None = None) -> Layout:
    """Check and decode a header block (exactly 8 + N bytes)."""
    if len(raw) < 8 + len(MAGIC) or raw[8 : 8 + len(MAGIC)] != MAGIC:
        raise TensorFormatError("not a tensorio file (bad magic)")
    m = _HDR_RE.match(raw, 8)
    if m is None:
        raise TensorChecksumError("tensorio header is corrupt (magic fields)")
    version = int(m.group(1))
    if version != VERSION:
        raise TensorFormatError(f"tensorio format version {version} is not supported")
    zeroed = bytearray(raw)
    zeroed[m.start(2) : m.end(2)] = b"0" * 16
    if xxh3(zeroed) != int(m.group(2), 16):
        raise TensorChecksumError("tensorio header checksum mismatch")
    try:
        hdr = json.loads(raw[8:])
        index = json.loads(hdr["__metadata__"]["index"])
        entries = [
            Entry(
                dtype=_BY_NAME[t["dtype"]],
                shape=tuple(t["shape"]),
                offset=int(t["offset"]),
                nbytes=int(t["nbytes"]),
                hashes=tuple(int(h, 16) for h in t["xxh3"]),
                param=bool(t.get("param", False)),
                requires_grad=bool(t.get("requires_grad", False)),
            )
            for t in index["tensors"]
        ]
        layout = Layout(
            tree=index["tree"],
            entries=entries,
            data_offset=len(raw),
            data_len=int(index["data_len"]),
            piece=int(index["piece"]),
            header=bytes(raw),
        )
    except (KeyError, ValueError, TypeError) as exc:  # checksum ok but content odd: a bug
        raise TensorFormatError(f"tensorio header is malformed: {exc}") from exc
    _validate(layout)
    if file_size is not None and file_size < layout.file_size:
        raise TensorFormatError(
            f"tensorio file is truncated ({file_size} < {layout.file_size} bytes)"
        )
    return layout


def _validate(layout: Layout) -> None:
    """A header can be well-formed and correctly checksummed yet inconsistent (crafted, or a
    bug): refuse it rather than build tensors from the wrong bytes."""
    if layout.data_len % PAGE or layout.piece <= 0 or layout.piece % PAGE:
        raise TensorFormatError("tensorio header: data length or piece size not 4 KiB-aligned")
    end = 0
    for i, e in enumerate(layout.entries):
        itemsize = torch.empty(0, dtype=e.dtype).element_size()
        if any(d < 0 for d in e.shape) or math.prod(e.shape) * itemsize != e.nbytes:
            raise TensorFormatError(f"tensorio header: tensor {i} shape/dtype/nbytes disagree")
        if e.offset < end or e.offset % SMALL_ALIGN or e.offset + e.nbytes > layout.data_len:
            raise TensorFormatError(f"tensorio header: tensor {i} offset out of place")
        if len(e.hashes) != len(e.pieces(layout.piece)):
            raise TensorFormatError(f"tensorio header: tensor {i} has the wrong number of hashes")
        end = e.offset + e.nbytes


def read_layout(path: str | os.PathLike[str]) -> Layout:
    """Read and check the header of a file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        first = os.pread(fd, PAGE, 0)
        if len(first) < 8:
            raise TensorFormatError("not a tensorio file (too short)")
        n = int.from_bytes(first[:8], "little")
        if n > MAX_HEADER or 8 + n > size:
            if first[8 : 8 + len(MAGIC)] != MAGIC:
                raise TensorFormatError("not a tensorio file (bad magic)")
            raise TensorChecksumError("tensorio header length is corrupt")
        raw = first[: 8 + n] if 8 + n <= len(first) else first + os.pread(fd, 8 + n - len(first), len(first))
        return parse_header(raw, size)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- checksums


def hash_piece(buf: Any, off: int, ln: int) -> int:
    return xxh3(buf[off : off + ln])


def verify_chunk(layout: Layout, chunk: Chunk, view: Any, base: int) -> None:
    """Check each piece of chunk; view holds data bytes starting at data offset `base`."""
    for ti, pi, off, ln in chunk.pieces:
        e = layout.entries[ti]
        if pi >= len(e.hashes) or xxh3(view[off - base : off - base + ln]) != e.hashes[pi]:
            raise TensorChecksumError(
                f"tensorio data checksum mismatch in tensor {ti} piece {pi} (data offset {off})"
            )
