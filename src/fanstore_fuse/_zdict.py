"""A zstd dictionary for small, similar files (`prep --dict auto`; codec 2, docs/format.md).

Trained once at prep from a bounded, deterministic sample of the small files (at most
MAX_SAMPLES files, SAMPLE_MAX bytes of each: memory independent of the file count), stored in
the manifest's `zdict` section (covered by its section checksum). Prep then compresses each
small whole-blob chunk with and without it and keeps the smaller.
"""

from __future__ import annotations

import logging
import os

import zstandard

from ._format import KIND_FILE
from ._walk import Listing

log = logging.getLogger("fanstore_fuse.prep")

SMALL = 128 << 10  # files up to this size are candidates (and chunks up to it may use codec 2)
MIN_FILES = 64  # fewer small files than this: no dictionary
MAX_SAMPLES = 1024
SAMPLE_MAX = 32 << 10  # bytes read from the start of each sampled file (<= 32 MiB in all)
DICT_SIZE = 64 << 10


def wanted(w: Listing) -> list[int]:
    """Entries to sample when the files are mostly small (median size <= SMALL) and there are
    at least MIN_FILES of them, else []. One pass over the size column, no per-file list."""
    kind, size = w.cols["kind"], w.cols["size"]
    files = small = 0
    for i in range(len(w)):
        if kind[i] == KIND_FILE:
            files += 1
            small += 0 < size[i] <= SMALL
    if small < MIN_FILES or 2 * small < files:
        return []
    stride = max(1, -(-small // MAX_SAMPLES))
    picked, seen = [], 0
    for i in range(len(w)):
        if kind[i] == KIND_FILE and 0 < size[i] <= SMALL:
            if seen % stride == 0:
                picked.append(i)
            seen += 1
    return picked


def train(w: Listing, level: int) -> bytes:
    """The dictionary for `w`'s small files, or b"" when they are too few or training fails."""
    picked = wanted(w)
    if not picked:
        return b""
    samples: list[bytes | bytearray | memoryview] = []
    for i in picked:
        try:
            fd = os.open(w.source(i), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # prep itself reports the file when it packs it
        try:
            samples.append(os.pread(fd, SAMPLE_MAX, 0))
        finally:
            os.close(fd)
    try:
        d = zstandard.train_dictionary(DICT_SIZE, samples, level=level)
    except zstandard.ZstdError as e:
        log.warning("no dictionary: training on %d samples failed (%s)", len(samples), e)
        return b""
    return bytes(d.as_bytes())
