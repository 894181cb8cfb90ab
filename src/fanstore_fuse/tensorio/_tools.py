"""Transfer tools: each moves the bytes of one tensorio file between storage and memory.

Every tool reads and writes the same file format (see ``_format``). A tool only moves the data
region; the API layer parses the header, allocates the destination, verifies checksums and
rebuilds the object tree. A tool that reads in chunks calls ``on_chunk`` with host bytes as each
chunk lands so that checksums are verified while the bytes are still in cache; chunks it does not
report are verified afterwards by the caller.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

import torch

from ._errors import TensorIOError
from ._format import PAGE, Chunk, Layout
from ._hostbuf import alloc_host  # noqa: F401  (re-exported for the API layer)

if TYPE_CHECKING:
    from typing_extensions import Buffer

OnChunk = Callable[[Chunk, Any, int], None]  # (chunk, host buffer, data offset of buffer[0])

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def threads() -> int:
    """One I/O thread per CPU, 2 to 8: past 8 concurrent preads a node-local NVMe or a page
    cache copy gains nothing more, and fewer than 2 cannot overlap a read with a copy."""
    return max(2, min(8, os.cpu_count() or 2))


def pool() -> ThreadPoolExecutor:
    """The shared I/O pool. Tasks submitted to it never wait on other pool tasks."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(threads(), thread_name_prefix="tensorio")
        return _POOL


def host_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview over a CPU uint8 tensor's bytes."""
    return memoryview(cast("Buffer", t.numpy())) if t.numel() else memoryview(bytearray())


def pread_full(fd: int, buf: memoryview, offset: int) -> None:
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        if n <= 0:
            raise TensorIOError(f"short read at offset {offset + got}: file truncated?")
        got += n


def pwrite_full(fd: int, bufs: Sequence[memoryview], offset: int) -> None:
    bufs = [b for b in bufs if len(b)]
    iov_max = 512
    while bufs:
        batch = bufs[:iov_max]
        want = sum(len(b) for b in batch)
        n = os.pwritev(fd, batch, offset)
        offset += n
        if n == want:
            bufs = bufs[iov_max:]
            continue
        # partial write: drop what was written and go on
        rest: list[memoryview] = []
        for b in bufs:
            if n >= len(b):
                n -= len(b)
            else:
                rest.append(b[n:])
                n = 0
        bufs = rest


def create_file(path: str, size: int, flags: int = 0) -> int:
    """Create path exclusively and reserve its size (fallocate when the fs supports it)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | flags, 0o644)
    try:
        if size:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


@runtime_checkable
class Tool(Protocol):
    """One way of moving a file's bytes. ``ops`` ⊆ {"read", "write"}; ``devices`` ⊆ {"cpu", "cuda"}."""

    name: str
    ops: frozenset[str]
    devices: frozenset[str]

    def probe(self, op: str, device: str, path: str) -> bool:
        """Can this tool do ``op`` for ``device`` on the file system holding ``path``?"""
        ...

    def read_into(
        self, path: str, layout: Layout, dest: torch.Tensor, on_chunk: OnChunk | None
    ) -> None:
        """Fill ``dest`` (uint8, ``layout.data_len`` bytes, on the target device) with the data."""
        ...

    def write(self, path: str, layout: Layout, sources: Sequence[memoryview]) -> None:
        """Create ``path`` holding ``layout.header`` then the data gathered from ``sources``."""
        ...


class _Base:
    name = "base"
    ops: frozenset[str] = frozenset({"read", "write"})
    devices: frozenset[str] = frozenset({"cpu"})

    def probe(self, op: str, device: str, path: str) -> bool:
        return op in self.ops and device in self.devices

    def __repr__(self) -> str:
        return f"<tensorio tool {self.name}>"


class PreadTool(_Base):
    """Threaded ``preadv``/``pwritev`` in chunks, straight into the destination buffer.

    For a CUDA destination it reads into a reusable pinned host buffer, then copies once.
    """

    name = "pread"

    def __init__(self) -> None:
        self._pinned: torch.Tensor | None = None
        self._lock = threading.Lock()
        if torch.cuda.is_available():
            self.devices = frozenset({"cpu", "cuda"})

    def _staging(self, n: int) -> torch.Tensor:
        if self._pinned is None or self._pinned.numel() < n:
            self._pinned = torch.empty(max(n, 1), dtype=torch.uint8, pin_memory=True)
        return self._pinned[:n]

    def read_into(self, path, layout, dest, on_chunk):
        if dest.device.type == "cpu":
            _chunked_read(path, layout, dest, on_chunk, 0)
            return
        with self._lock:
            host = self._staging(layout.data_len)
            _chunked_read(path, layout, host, on_chunk, 0)
            dest.copy_(host, non_blocking=True)
            torch.cuda.current_stream(dest.device).synchronize()

    def write(self, path, layout, sources):
        fd = create_file(path, layout.file_size)
        try:
            pwrite_full(fd, [memoryview(layout.header)], 0)
            base = layout.data_offset
            list(
                pool().map(
                    lambda c: pwrite_full(fd, layout.gather(sources, c.start, c.end), base + c.start),
                    layout.chunks(),
                )
            )
        finally:
            os.close(fd)


def _chunked_read(
    path: str, layout: Layout, dest: torch.Tensor, on_chunk: OnChunk | None, flags: int
) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | flags)
    try:
        view = host_view(dest)
        base = layout.data_offset

        def one(c: Chunk) -> None:
            pread_full(fd, view[c.start : c.end], base + c.start)
            if on_chunk is not None:
                on_chunk(c, view, 0)

        list(pool().map(one, layout.chunks()))
    finally:
        os.close(fd)


_DIRECT_OK: dict[tuple[int, str], bool] = {}


class DirectTool(_Base):
    """O_DIRECT reads/writes with page-aligned buffers, bypassing the page cache.

    Probed once per (device id, op) by a real aligned O_DIRECT access on that file system;
    file systems that refuse it (tmpfs, some FUSE mounts) make the tool ineligible, and a
    runtime EINVAL falls back to buffered I/O for that call.
    """

    name = "odirect"

    def __init__(self) -> None:
        self._tls = threading.local()

    def probe(self, op, device, path):
        if not super().probe(op, device, path) or not hasattr(os, "O_DIRECT"):
            return False
        where = path if op == "read" else os.path.dirname(os.path.abspath(path)) or "."
        try:
            key = (os.stat(where).st_dev, op)
        except OSError:
            return False
        if key not in _DIRECT_OK:
            _DIRECT_OK[key] = _probe_direct(op, where)
        return _DIRECT_OK[key]

    def _buf(self, n: int) -> memoryview:
        b = getattr(self._tls, "buf", None)
        if b is None or len(b) < n:
            b = mmap.mmap(-1, max(n, PAGE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self._tls.buf = b
        return memoryview(b)[:n]

    def read_into(self, path, layout, dest, on_chunk):
        if dest.device.type != "cpu" or dest.numel() and dest.data_ptr() % PAGE:
            _chunked_read(path, layout, dest, on_chunk, 0)
            return
        try:
            _chunked_read(path, layout, dest, on_chunk, os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            _chunked_read(path, layout, dest, on_chunk, 0)

    def write(self, path, layout, sources):
        try:
            fd = create_file(path, 0, os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            PreadTool.write(self, path, layout, sources)  # type: ignore[arg-type]
            return
        try:
            base = layout.data_offset

            def put(bufs: Sequence[memoryview], n: int, off: int) -> None:
                stage = self._buf(n)
                pos = 0
                for b in bufs:
                    stage[pos : pos + len(b)] = b
                    pos += len(b)
                pwrite_full(fd, [stage], off)

            put([memoryview(layout.header)], base, 0)
            list(
                pool().map(
                    lambda c: put(layout.gather(sources, c.start, c.end), c.nbytes, base + c.start),
                    layout.chunks(),
                )
            )
        finally:
            os.close(fd)


def _probe_direct(op: str, where: str) -> bool:
    buf = mmap.mmap(-1, PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        if op == "read":
            fd = os.open(where, os.O_RDONLY | os.O_DIRECT)
            try:
                os.preadv(fd, [buf], 0)
            finally:
                os.close(fd)
            return True
        probe = os.path.join(where, f".tensorio-direct-probe-{os.getpid()}")
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            os.pwritev(fd, [buf], 0)
        finally:
            os.close(fd)
            os.unlink(probe)
        return True
    except OSError:
        return False
    finally:
        buf.close()


class MmapTool(_Base):
    """numpy.memmap of the file; chunks are copied in parallel (numpy releases the GIL)."""

    name = "mmap"

    def read_into(self, path, layout, dest, on_chunk):
        import numpy as np

        if layout.data_len == 0:
            return
        mm = np.memmap(path, dtype=np.uint8, mode="r", offset=layout.data_offset,
                       shape=(layout.data_len,))
        out = dest.numpy()
        view = host_view(dest)

        def one(c: Chunk) -> None:
            np.copyto(out[c.start : c.end], mm[c.start : c.end])
            if on_chunk is not None:
                on_chunk(c, view, 0)

        list(pool().map(one, layout.chunks()))

    def write(self, path, layout, sources):
        import numpy as np

        os.close(create_file(path, layout.file_size))
        mm = np.memmap(path, dtype=np.uint8, mode="r+", shape=(layout.file_size,))
        mm[: layout.data_offset] = np.frombuffer(layout.header, dtype=np.uint8)
        base = layout.data_offset

        def one(c: Chunk) -> None:
            pos = base + c.start
            for b in layout.gather(sources, c.start, c.end):
                mm[pos : pos + len(b)] = np.frombuffer(b, dtype=np.uint8)
                pos += len(b)

        list(pool().map(one, layout.chunks()))


class TorchTool(_Base):
    """torch's own file mapping (``UntypedStorage.from_file``), private for reads, shared for
    writes. The torch.save/torch.load *format* is only a baseline in the bench."""

    name = "torch"

    def read_into(self, path, layout, dest, on_chunk):
        if layout.data_len == 0:
            return
        st = torch.UntypedStorage.from_file(path, shared=False, nbytes=layout.file_size)
        src = torch.empty(0, dtype=torch.uint8).set_(st)[layout.data_offset :]
        view = host_view(dest) if dest.device.type == "cpu" else None

        def one(c: Chunk) -> None:
            dest[c.start : c.end].copy_(src[c.start : c.end])
            if on_chunk is not None and view is not None:
                on_chunk(c, view, 0)

        list(pool().map(one, layout.chunks()))

    def write(self, path, layout, sources):
        os.close(create_file(path, layout.file_size))
        st = torch.UntypedStorage.from_file(path, shared=True, nbytes=layout.file_size)
        out = torch.empty(0, dtype=torch.uint8).set_(st)
        out[: layout.data_offset].copy_(torch.frombuffer(bytearray(layout.header), dtype=torch.uint8))
        base = layout.data_offset

        def one(c: Chunk) -> None:
            pos = base + c.start
            for b in layout.gather(sources, c.start, c.end):
                n = len(b)
                out[pos : pos + n].copy_(torch.frombuffer(b, dtype=torch.uint8))
                pos += n

        list(pool().map(one, layout.chunks()))


class SafetensorsTool(_Base):
    """``safetensors.safe_open`` on the same file (its header is safetensors-valid). Read only."""

    name = "safetensors"
    ops = frozenset({"read"})

    def __init__(self) -> None:
        if torch.cuda.is_available():
            self.devices = frozenset({"cpu", "cuda"})

    def probe(self, op, device, path):
        if not super().probe(op, device, path):
            return False
        try:
            import safetensors  # noqa: F401
        except ImportError:
            return False
        return True

    def read_into(self, path, layout, dest, on_chunk):
        from safetensors import safe_open

        dev = str(dest.device) if dest.device.type != "cpu" else "cpu"
        with safe_open(path, framework="pt", device=dev) as f:
            for i, e in enumerate(layout.entries):
                if e.nbytes == 0:
                    continue
                t = f.get_tensor(f"t{i}")
                dest[e.offset : e.offset + e.nbytes].copy_(t.reshape(-1).view(torch.uint8))

    def write(self, path, layout, sources):  # pragma: no cover - not registered for writes
        raise TensorIOError("the safetensors tool only reads")


def cpu_tools() -> list[Tool]:
    return [PreadTool(), DirectTool(), MmapTool(), TorchTool(), SafetensorsTool()]
