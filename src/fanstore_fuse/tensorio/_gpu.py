"""GPU transfer tools. ``gpu_tools()`` returns only those whose probe succeeds on this machine:
CUDA present and the module importable (and, per file system, a trial read works)."""

from __future__ import annotations

import collections
import os
import threading
from concurrent.futures import Future

import torch

from ._format import Chunk
from ._tools import _Base, host_view, pool, pread_full


def cuda_ok() -> bool:
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - broken driver
        return False


class PinnedStreamTool(_Base):
    """Threaded preads into a ring of reusable pinned buffers; each chunk is copied to the
    device on a side stream while the next chunks are read (double/quad buffering)."""

    name = "pinned-stream"
    ops = frozenset({"read"})
    devices = frozenset({"cuda"})
    nbuf = 4

    def __init__(self) -> None:
        self._ring: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def probe(self, op, device, path):
        return super().probe(op, device, path) and cuda_ok()

    def _buffers(self, n: int) -> list[torch.Tensor]:
        if not self._ring or self._ring[0].numel() < n:
            self._ring = [
                torch.empty(max(n, 1), dtype=torch.uint8, pin_memory=True) for _ in range(self.nbuf)
            ]
        return self._ring

    def read_into(self, path, layout, dest, on_chunk):
        chunks = layout.chunks()
        if not chunks:
            return
        with self._lock:
            ring = self._buffers(max(c.nbytes for c in chunks))
            views = [host_view(b) for b in ring]
            stream = torch.cuda.Stream(device=dest.device)
            stream.wait_stream(torch.cuda.current_stream(dest.device))
            events: list[torch.cuda.Event | None] = [None] * self.nbuf
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:

                def rd(c: Chunk, b: int) -> None:
                    ev = events[b]
                    if ev is not None:
                        ev.synchronize()  # the previous copy out of this buffer is done
                    pread_full(fd, views[b][: c.nbytes], layout.data_offset + c.start)
                    if on_chunk is not None:
                        on_chunk(c, views[b], c.start)

                pending: collections.deque[Future[None]] = collections.deque()
                for i in range(min(self.nbuf, len(chunks))):
                    pending.append(pool().submit(rd, chunks[i], i))
                for i, c in enumerate(chunks):
                    pending.popleft().result()
                    b = i % self.nbuf
                    with torch.cuda.stream(stream):
                        dest[c.start : c.end].copy_(ring[b][: c.nbytes], non_blocking=True)
                        ev = torch.cuda.Event()
                        ev.record(stream)
                    events[b] = ev
                    if i + self.nbuf < len(chunks):
                        pending.append(pool().submit(rd, chunks[i + self.nbuf], b))
                stream.synchronize()
            finally:
                os.close(fd)


class KvikioTool(_Base):
    """KvikIO ``CuFile.pread`` straight into device memory (GDS when available, else its own
    POSIX bounce path). Needs libcuda even for host buffers, hence CUDA-only."""

    name = "kvikio"
    ops = frozenset({"read"})
    devices = frozenset({"cuda"})

    def probe(self, op, device, path):
        if not super().probe(op, device, path) or not cuda_ok():
            return False
        try:
            import kvikio  # noqa: F401
        except Exception:
            return False
        return True

    def read_into(self, path, layout, dest, on_chunk):
        import kvikio

        with kvikio.CuFile(path, "r") as f:
            futs = [
                f.pread(dest[c.start : c.end], c.nbytes, file_offset=layout.data_offset + c.start)
                for c in layout.chunks()
            ]
            for fu in futs:
                fu.get()


_GDS_OK: dict[int, bool] = {}


class GdsTool(_Base):
    """torch.cuda.gds.GdsFile: cuFile reads into a device storage. Probed per file system with
    a trial read (GDS does not work through FUSE; compat mode at best)."""

    name = "gds"
    ops = frozenset({"read"})
    devices = frozenset({"cuda"})

    def probe(self, op, device, path):
        if not super().probe(op, device, path) or not cuda_ok():
            return False
        if not hasattr(torch.cuda, "gds") or not hasattr(torch.cuda.gds, "GdsFile"):
            return False
        try:
            dev = os.stat(path).st_dev
        except OSError:
            return False
        if dev not in _GDS_OK:
            try:
                buf = torch.empty(4096, dtype=torch.uint8, device="cuda")
                f = torch.cuda.gds.GdsFile(path, os.O_RDONLY)
                f.load_storage(buf.untyped_storage(), 0)
                torch.cuda.synchronize()
                _GDS_OK[dev] = True
            except Exception:
                _GDS_OK[dev] = False
        return _GDS_OK[dev]

    def read_into(self, path, layout, dest, on_chunk):
        if layout.data_len == 0:
            return
        f = torch.cuda.gds.GdsFile(path, os.O_RDONLY)
        f.load_storage(dest.untyped_storage(), layout.data_offset)


def gpu_tools() -> list[_Base]:
    """GPU tools whose machine-level probe succeeds (none on a CPU-only machine)."""
    if not cuda_ok():
        return []
    out: list[_Base] = [PinnedStreamTool()]
    if KvikioTool().probe("read", "cuda", "/"):
        out.append(KvikioTool())
    if hasattr(torch.cuda, "gds") and hasattr(torch.cuda.gds, "GdsFile"):
        out.append(GdsTool())
    return out
