"""Feature-map offload: saved activations above a threshold go to node-local storage.

Inside ``with offload(dir):`` autograd's saved tensors of at least ``threshold`` bytes are written
by a background writer thread through ``save()`` (so through the selected tool) and dropped from
memory once written; backward reads them back through ``load()``, prefetching the next ones (in
reverse order of saving, the order backward normally needs them) on a background reader. Both
threads are joined and the files removed when the context exits.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ._api import load, save
from ._selector import Selector


class _Handle:
    __slots__ = ("idx", "path", "device", "written")

    def __init__(self, idx: int, path: str, device: torch.device, written: Future[Any]) -> None:
        self.idx, self.path, self.device, self.written = idx, path, device, written


class offload:  # noqa: N801 - used like a function: `with offload(dir):`
    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        threshold: int = 1 << 20,
        prefetch: int = 2,
        tool_write: str | None = None,
        tool_read: str | None = None,
        selector: Selector | None = None,
        verify: bool = True,
    ) -> None:
        self.directory = os.fspath(directory) if directory is not None else None
        self.threshold = threshold
        self.prefetch = max(0, prefetch)
        self.tool_write, self.tool_read = tool_write, tool_read
        self.selector = selector
        self.verify = verify
        self.stats = {"offloaded": 0, "kept": 0, "bytes": 0, "prefetch_hits": 0}
        self._dir: str | None = None
        self._ids = itertools.count()
        self._handles: dict[int, _Handle] = {}
        self._loads: dict[int, Future[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._hooks: Any = None

    # --------------------------------------------------------------- context

    def __enter__(self) -> offload:
        if self.directory is not None:
            os.makedirs(self.directory, exist_ok=True)
        self._dir = tempfile.mkdtemp(prefix="tensorio-offload-", dir=self.directory)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tensorio-offload-w")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="tensorio-offload-r")
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._hooks.__exit__(*exc)
        finally:
            self._writer.shutdown(wait=True)
            self._reader.shutdown(wait=True)
            if self._dir:
                shutil.rmtree(self._dir, ignore_errors=True)

    # --------------------------------------------------------------- hooks

    def _pack(self, t: torch.Tensor) -> Any:
        n = t.numel() * t.element_size()
        if (
            n < self.threshold
            or isinstance(t, torch.nn.Parameter)
            or t.layout != torch.strided
            or t.is_sparse
        ):
            self.stats["kept"] += 1
            return t
        idx = next(self._ids)
        assert self._dir is not None
        path = os.path.join(self._dir, f"act-{idx}.fstio")
        data = t.detach()
        fut = self._writer.submit(save, data, path, tool=self.tool_write, selector=self.selector)
        h = _Handle(idx, path, t.device, fut)
        with self._lock:
            self._handles[idx] = h
        self.stats["offloaded"] += 1
        self.stats["bytes"] += n
        return h

    def _read(self, h: _Handle) -> torch.Tensor:
        h.written.result()
        return load(h.path, h.device, tool=self.tool_read, verify=self.verify,
                    selector=self.selector)

    def _unpack(self, h: Any) -> torch.Tensor:
        if not isinstance(h, _Handle):
            return h
        with self._lock:
            fut = self._loads.pop(h.idx, None)
            if fut is not None:
                self.stats["prefetch_hits"] += 1
            else:
                fut = self._reader.submit(self._read, h)
            # prefetch the next ones backward will want: the previously packed tensors
            self._handles.pop(h.idx, None)
            nxt = sorted((i for i in self._handles if i < h.idx and i not in self._loads),
                         reverse=True)
            for i in nxt[: self.prefetch]:
                self._loads[i] = self._reader.submit(self._read, self._handles[i])
        return fut.result()
