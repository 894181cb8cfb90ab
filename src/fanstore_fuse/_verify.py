"""`verify`: check the manifest and every blob's checksum in a prepped DEST."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ._blobstore import BlobStore
from ._errors import FanstoreError
from ._format import MANIFEST_NAME, PARTITION_DATA_START, check_partition_header, read_manifest
from ._namespace import Namespace


@dataclass
class VerifyReport:
    entries: int = 0
    blobs: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify(
    dest: str, workers: int = 0, progress: Callable[[int], None] | None = None
) -> VerifyReport:
    """Raise FormatError if the manifest itself is bad; otherwise list every damaged blob."""
    m = read_manifest(os.path.join(dest, MANIFEST_NAME))
    ns = Namespace(m)
    rep = VerifyReport(entries=m.n_entries, blobs=m.n_blobs)
    owner: dict[int, int] = {}
    for i in range(len(ns)):
        for b in ns.blobs(i):
            owner[b] = i
    for p, info in enumerate(m.partitions):
        path = os.path.join(dest, info.name)
        try:
            with open(path, "rb") as f:
                check_partition_header(f.read(PARTITION_DATA_START), p, m.dataset_id, info.name)
            size = os.path.getsize(path)
            if size != info.size:
                rep.problems.append(f"partition {info.name}: {size} bytes, manifest says {info.size}")
        except FileNotFoundError:
            rep.problems.append(f"partition {info.name}: missing")
        except FanstoreError as e:
            rep.problems.append(str(e))
    store = BlobStore(m, dest)

    def check(b: int) -> str | None:
        try:
            store.raw(b)
        except FanstoreError as e:
            f = owner.get(b)
            who = os.fsdecode(ns.path(f)) if f is not None else "(no file)"
            return f"{who}: {e}"
        finally:
            if progress:
                progress(store.raw_size(b))
        return None

    try:
        with ThreadPoolExecutor(max_workers=workers or (os.cpu_count() or 1)) as pool:
            for res in pool.map(check, range(m.n_blobs), chunksize=64):
                if res:
                    rep.problems.append(res)
    finally:
        store.close()
    rep.bytes = m.total_bytes()
    return rep
