"""`verify`: check the manifest and every blob's checksum in a prepped DEST.

Streaming: blobs are checked in a bounded window of a thread pool, walked file by file from the
mapped manifest, so memory does not grow with the file count.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ._blobstore import BlobStore
from ._errors import FanstoreError
from ._format import KIND_FILE, MANIFEST_NAME, PARTITION_DATA_START, check_partition_header
from ._manifest import read_manifest
from ._namespace import Namespace
from ._prep import ordered_map


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
    kinds = m.entries["kind"]

    def jobs() -> Iterator[tuple[int, int]]:  # (file entry, blob), blobs in id order
        for i in range(m.n_entries):
            if kinds[i] == KIND_FILE:
                for b in ns.blobs(i):
                    yield i, b

    def check(job: tuple[int, int]) -> str | None:
        i, b = job
        try:
            store.raw(b)
        except FanstoreError as e:
            return f"{os.fsdecode(ns.path(i))}: {e}"
        finally:
            if progress:
                progress(store.raw_size(b))
        return None

    n = workers or (os.cpu_count() or 1)
    try:
        with ThreadPoolExecutor(max_workers=n) as pool:
            for res in ordered_map(pool, check, jobs(), window=n * 8):
                if res:
                    rep.problems.append(res)
    finally:
        store.close()
    rep.bytes = m.total_bytes()
    return rep
