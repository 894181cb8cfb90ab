"""save() / load(): flatten, checksum, pick a tool, move bytes, verify, rebuild."""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections.abc import Sequence
from typing import Any, cast

import torch

from . import _format as fmt
from ._errors import TensorChecksumError, TensorFormatError, TensorIOError
from ._fs import cache_state, fs_type
from ._gpu import gpu_tools
from ._selector import Selector, default_selector, make_key
from ._tools import Tool, alloc_host, cpu_tools, host_view, pool

_REGISTRY: dict[str, Tool] = {}
_REG_LOCK = threading.Lock()


def _ensure_registry() -> dict[str, Tool]:
    with _REG_LOCK:
        if not _REGISTRY:
            # GPU tools are read-only (ops == {"read"}): no `write`, so not a full `Tool`.
            for t in [*cpu_tools(), *cast("list[Tool]", gpu_tools())]:
                _REGISTRY[t.name] = t
        return _REGISTRY


def tools() -> dict[str, Tool]:
    """Registered tools by name (GPU tools only when their machine-level probe succeeded)."""
    return dict(_ensure_registry())


def register(tool: Tool) -> None:
    """Add (or replace) a tool; it takes part in selection from the next call."""
    _ensure_registry()
    with _REG_LOCK:
        _REGISTRY[tool.name] = tool


def unregister(name: str) -> None:
    with _REG_LOCK:
        _REGISTRY.pop(name, None)


def eligible(op: str, device: str, path: str) -> list[str]:
    out = []
    for name, t in tools().items():
        try:
            if t.probe(op, device, path):
                out.append(name)
        except Exception:
            continue
    return out


def _device(device: str | torch.device) -> torch.device:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run(
    op: str,
    device: torch.device,
    path: str,
    nbytes: int,
    cache: str,
    tool: str | None,
    selector: Selector | None,
    fn: Any,
) -> str:
    """Pick a tool, time fn(tool) (synchronising CUDA), record; on failure try the next tool."""
    sel = selector or default_selector()
    where = path if op == "read" else os.path.dirname(os.path.abspath(path))
    key = make_key(op, device.type, nbytes, cache, fs_type(where))
    names = eligible(op, device.type, path)
    if not names:
        raise TensorIOError(f"no tensorio tool can {op} on {device.type} here")
    errors = []
    while names:
        name = sel.choose(key, names, override=tool)
        _sync(device)
        t0 = sel.clock()
        try:
            fn(tools()[name])
            _sync(device)
        except (TensorChecksumError, TensorFormatError):
            raise
        except Exception as exc:
            if tool or os.environ.get("FANSTORE_TENSORIO_TOOL"):
                raise
            errors.append(f"{name}: {exc!r}")
            sel.fail(key, name)
            names = [n for n in names if n != name]
            continue
        if not (tool or os.environ.get("FANSTORE_TENSORIO_TOOL")):
            sel.record(key, name, sel.clock() - t0, nbytes)  # forced calls teach nothing
        return name
    raise TensorIOError(f"every tensorio tool failed to {op} {path}: " + "; ".join(errors))


# ----------------------------------------------------------------------------- save


def save(
    obj: Any,
    path: str | os.PathLike[str],
    *,
    tool: str | None = None,
    fsync: bool = False,
    selector: Selector | None = None,
) -> str:
    """Write obj (a tensor or a nested dict/list/tuple of tensors and plain values) to path.

    The file appears atomically (written under a temporary name in the same directory, then
    renamed). ``fsync=True`` also makes it durable. Returns the name of the tool used.
    """
    path = os.fspath(path)
    tree, tensors = fmt.flatten(obj)
    entries, data_len = fmt.plan(tensors)
    sources = [host_view(fmt.host_bytes(t)) for t in tensors]
    entries = _hash_entries(entries, sources)
    header = fmt.encode_header(tree, entries, data_len, piece=fmt.PIECE)
    layout = fmt.Layout(tree, entries, len(header), data_len, piece=fmt.PIECE, header=header)
    d = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(d, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:12]}")
    device = _device("cpu")

    def do(t: Tool) -> None:
        try:
            t.write(tmp, layout, sources)
        except BaseException:
            _unlink(tmp)
            raise

    try:
        used = _run("write", device, path, data_len, "-", tool, selector, do)
        if fsync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
        if fsync:
            dfd = os.open(d, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
    except BaseException:
        _unlink(tmp)
        raise
    return used


def _unlink(p: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(p)


def _hash_entries(entries: list[fmt.Entry], sources: Sequence[memoryview]) -> list[fmt.Entry]:
    jobs = [
        (i, src, p * fmt.PIECE, ln)
        for i, (e, src) in enumerate(zip(entries, sources, strict=True))
        for p, (_, ln) in enumerate(e.pieces(fmt.PIECE))
    ]
    small = [j for j in jobs if j[3] < (256 << 10)]
    big = [j for j in jobs if j[3] >= (256 << 10)]
    digests: dict[tuple[int, int], int] = {}
    for i, src, off, ln in small:
        digests[(i, off)] = fmt.xxh3(src[off : off + ln])
    for (i, _, off, _), h in zip(
        big, pool().map(lambda j: fmt.xxh3(j[1][j[2] : j[2] + j[3]]), big), strict=True
    ):
        digests[(i, off)] = h
    out = []
    for i, e in enumerate(entries):
        hs = tuple(digests[(i, p * fmt.PIECE)] for p in range(len(e.pieces(fmt.PIECE))))
        out.append(fmt.Entry(e.dtype, e.shape, e.offset, e.nbytes, hs, e.param, e.requires_grad))
    return out


# ----------------------------------------------------------------------------- load


class _Verifier:
    """Checks each chunk once, in whichever thread delivers it."""

    def __init__(self, layout: fmt.Layout) -> None:
        self.layout = layout
        self.done: set[int] = set()
        self.lock = threading.Lock()

    def on_chunk(self, c: fmt.Chunk, view: Any, base: int) -> None:
        fmt.verify_chunk(self.layout, c, view, base)
        with self.lock:
            self.done.add(c.start)

    def finish(self, dest: torch.Tensor) -> None:
        todo = [c for c in self.layout.chunks() if c.start not in self.done]
        if not todo:
            return
        if dest.device.type == "cpu":
            view = host_view(dest)
            list(pool().map(lambda c: fmt.verify_chunk(self.layout, c, view, 0), todo))
            return
        for c in todo:  # device-direct tools: verify from a host copy
            host = dest[c.start : c.end].cpu()
            fmt.verify_chunk(self.layout, c, host_view(host), c.start)


def load(
    path: str | os.PathLike[str],
    device: str | torch.device = "cpu",
    *,
    tool: str | None = None,
    verify: bool = True,
    mmap: bool = False,
    selector: Selector | None = None,
) -> Any:
    """Read a file written by save(). All tensors are views of one buffer on ``device``.

    ``verify=True`` checks every tensor byte against its xxh3-64 (the header is always
    checked); a mismatch raises TensorChecksumError and returns nothing.

    ``mmap=True`` (CPU only; like ``torch.load(mmap=True)``) maps the data region privately
    (copy-on-write) instead of copying it: no tool runs, pages come from the page cache, writes
    to the tensors never reach the file. save() replaces files by rename, so a mapped file never
    changes under its tensors; a file truncated in place by another program would (SIGBUS).
    """
    path = os.fspath(path)
    dev = _device(device)
    layout = fmt.read_layout(path)
    if mmap and dev.type == "cpu":
        dest = _map_private(path, layout)
        if verify:
            _Verifier(layout).finish(dest)
        return fmt.unflatten(layout.tree, [fmt.view_tensor(dest, e) for e in layout.entries])
    cache = cache_state(path, layout.data_offset, layout.data_len) if layout.data_len else "warm"
    holder: dict[str, torch.Tensor] = {}

    def do(t: Tool) -> None:
        dest = (
            alloc_host(layout.data_len)
            if dev.type == "cpu"
            else torch.empty(layout.data_len, dtype=torch.uint8, device=dev)
        )
        ver = _Verifier(layout) if verify else None
        t.read_into(path, layout, dest, ver.on_chunk if ver else None)
        if ver is not None:
            ver.finish(dest)
        holder["dest"] = dest

    _run("read", dev, path, layout.data_len, cache, tool, selector, do)
    dest = holder["dest"]
    tensors = [fmt.view_tensor(dest, e) for e in layout.entries]
    return fmt.unflatten(layout.tree, tensors)


def _map_private(path: str, layout: fmt.Layout) -> torch.Tensor:
    import mmap as _mmap

    if layout.data_len == 0:
        return torch.empty(0, dtype=torch.uint8)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        mm = _mmap.mmap(fd, layout.data_len, flags=_mmap.MAP_PRIVATE,
                        prot=_mmap.PROT_READ | _mmap.PROT_WRITE, offset=layout.data_offset)
    finally:
        os.close(fd)
    with contextlib.suppress(OSError, AttributeError):
        mm.madvise(_mmap.MADV_WILLNEED)
    return torch.frombuffer(mm, dtype=torch.uint8)


def info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Header summary: version, offsets and each tensor's dtype/shape/nbytes."""
    lay = fmt.read_layout(path)
    return {
        "version": fmt.VERSION,
        "data_offset": lay.data_offset,
        "data_len": lay.data_len,
        "tensors": [
            {"dtype": str(e.dtype), "shape": list(e.shape), "offset": e.offset, "nbytes": e.nbytes}
            for e in lay.entries
        ],
    }
