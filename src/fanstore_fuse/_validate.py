"""Full validation of a manifest, vectorized over its columns (numpy, in bounded chunks).

Every rule of docs/format.md "Validation" is checked here in O(entries + blobs) numpy work and
bounded temporaries (chunks of at most `CHUNK` items), so a 14M-entry manifest validates in
about a second without a per-entry Python object. The first offending entry or blob is named.
"""

from __future__ import annotations

import stat
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import numpy as np

from ._errors import FormatError
from ._format import (
    BLOB_COLUMNS,
    CODEC_FRAMED,
    CODEC_RAW,
    CODEC_ZSTD,
    CODEC_ZSTD_DICT,
    DEFAULT_CHUNK_SIZE,
    ENTRY_COLUMNS,
    FRAME_ENTRY,
    FRAME_HEAD,
    KIND_DIR,
    KIND_FILE,
    KIND_LINK,
    MAX_CHUNK_SIZE,
    MAX_LINK,
    MAX_NAME,
    MIN_FRAME,
    PARTITION_DATA_START,
    PARTITION_NAME_RE,
    Manifest,
    partition_name,
)

CHUNK = 1 << 18
# The smallest framed blob: its table with one frame, and that frame's one stored byte.
_FRAMED_MIN = FRAME_HEAD + FRAME_ENTRY + 1
_DTYPE = {"B": "<u1", "I": "<u4", "q": "<i8", "Q": "<u8"}
_IFMT = np.array([stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK], dtype=np.uint32)


def _col(buf: Any, typecode: str, n: int, what: str) -> np.ndarray:
    a = np.frombuffer(memoryview(buf).cast("B"), dtype=_DTYPE[typecode])
    if len(a) != n:
        raise FormatError(f"manifest column {what!r} has {len(a)} items, expected {n}")
    return a


# (part, parts): this validation checks the part-th of `parts` contiguous runs of every loop's
# chunks (`validate(m, part, parts)`: the ranks of a mount share the work).
_SHARE: ContextVar[tuple[int, int]] = ContextVar("validate_share", default=(0, 1))
# The manifest being validated: the loops unmap the mapped pages they touched every DROP_CHUNKS
# chunks (the pages stay in the page cache), so the process holds a bounded part of the file.
_PAGES: ContextVar[Manifest | None] = ContextVar("validate_pages", default=None)
DROP_CHUNKS = 4


def _mine(lo: int, hi: int) -> range:
    """The chunk numbers of range(lo, hi) this validation checks."""
    count = max(0, -(-(hi - lo) // CHUNK))
    part, parts = _SHARE.get()
    return range(count * part // parts, count * (part + 1) // parts)


def _chunks(lo: int, hi: int) -> Iterator[tuple[int, int]]:
    m = _PAGES.get()
    for k, c in enumerate(_mine(lo, hi)):
        if m is not None and k % DROP_CHUNKS == DROP_CHUNKS - 1:
            m.drop_pages()
        a = lo + c * CHUNK
        yield a, min(a + CHUNK, hi)


def _owns_last(lo: int, hi: int) -> bool:
    mine = _mine(lo, hi)
    return hi <= lo or (len(mine) > 0 and mine[-1] == -(-(hi - lo) // CHUNK) - 1)


def _first(mask: np.ndarray, base: int = 0) -> int | None:
    hit = np.flatnonzero(mask)
    return int(hit[0]) + base if len(hit) else None


def _fail_at(mask: np.ndarray, base: int, msg: str) -> None:
    i = _first(mask, base)
    if i is not None:
        raise FormatError(msg.format(i=i))


def validate(m: Manifest, part: int = 0, parts: int = 1) -> int:
    """Check every rule, or with `parts` > 1 the global ones and the `part`-th share of every
    per-item loop. Returns the number of children the share's directories list: the shares'
    sum must be `check_children`ed (with one part it is checked here)."""
    token, pages = _SHARE.set((part, parts)), _PAGES.set(m)
    try:
        children = _validate(m)
    finally:
        _SHARE.reset(token)
        _PAGES.reset(pages)
    if parts == 1:
        check_children(children, m.n_entries)
    return children


def check_children(total: int, n: int) -> None:
    if total != n - 1:
        raise FormatError("directory listings do not cover every entry exactly once")


def _validate(m: Manifest) -> int:
    n, nb = m.n_entries, m.n_blobs
    e = {k: _col(m.entries[k], t, n, k) for k, t in ENTRY_COLUMNS.items()}
    b = {k: _col(m.blobs[k], t, nb, k) for k, t in BLOB_COLUMNS.items()}
    off = _col(m.name_off, "Q", n + 1, "name_off")
    names = np.frombuffer(memoryview(m.names).cast("B"), dtype=np.uint8)
    links = np.frombuffer(memoryview(m.links).cast("B"), dtype=np.uint8)
    _name_table(off, len(names), n)
    chunk = check_partitions(m)
    _root_and_kinds(e, n)
    children = _tree(e, n)
    # Each pass below walks whole columns of the mapping; unmapping the pages a pass touched
    # (they stay in the page cache) keeps this process's resident share to about one pass.
    m.drop_pages()
    _names(off, names, n)
    m.drop_pages()
    _sorted(e["parent"], off, names, n)
    m.drop_pages()
    _blobs(m, b, chunk, nb)
    m.drop_pages()
    _files(e, b["raw"], chunk, n, nb)
    m.drop_pages()
    _links(e, len(links), n)
    for a, z in _chunks(0, len(links)):
        if _first(links[a:z] == 0) is not None:
            raise FormatError("a symlink target contains NUL")
    return children


def _name_table(off: np.ndarray, heap: int, n: int) -> None:
    if off[0] != 0 or off[n] != heap:
        raise FormatError("manifest name table is inconsistent")
    if off[1] != 0:
        raise FormatError("entry 0 (the root) has a name; the root's name is empty")
    for a, z in _chunks(0, n):
        _fail_at(off[a + 1 : z + 1] < off[a:z], a,
                 "manifest name table is inconsistent (offsets decrease at entry {i})")


def check_partitions(m: Manifest) -> int:
    """The partition table (safe file names, sizes) and the chunk size: all stage-in needs."""
    for i, p in enumerate(m.partitions):
        if not PARTITION_NAME_RE.fullmatch(p.name):
            raise FormatError(f"partition {i} has an unsafe file name {p.name!r}")
        if p.size < PARTITION_DATA_START:
            raise FormatError(f"partition {i} size {p.size} is too small")
    if len({p.name for p in m.partitions}) != len(m.partitions):
        raise FormatError("duplicate partition names")
    last = len(m.partitions) - 1
    for i, p in enumerate(m.partitions):  # part-NNNNN for 0..N-1; bcast-N, the last, flagged
        want = partition_name(i, p.broadcast)
        if p.name != want or (p.broadcast and i != last):
            raise FormatError(f"partition {i} is named {p.name!r} (broadcast {p.broadcast}), "
                              f"expected {partition_name(i)!r} or, the last only, "
                              f"{partition_name(i, True)!r} with the broadcast flag")
    chunk = m.options.get("chunk_size", DEFAULT_CHUNK_SIZE)
    if type(chunk) is not int or not 4096 <= chunk <= MAX_CHUNK_SIZE:
        raise FormatError(f"chunk size {chunk!r} out of range (4096 .. {MAX_CHUNK_SIZE})")
    return chunk


def _root_and_kinds(e: dict[str, np.ndarray], n: int) -> None:
    kind, mode = e["kind"], e["mode"]
    if kind[0] != KIND_DIR or e["parent"][0] != 0 or not stat.S_ISDIR(int(mode[0])):
        raise FormatError("entry 0 is not the root directory")
    for a, z in _chunks(0, n):
        k, md = kind[a:z], mode[a:z]
        _fail_at(k > KIND_LINK, a, "entry {i} has an unknown kind")
        _fail_at(md & (stat.S_ISUID | stat.S_ISGID), a, "entry {i} has setuid/setgid bits")
        _fail_at((md & 0o170000) != _IFMT[k], a, "entry {i}: kind/mode mismatch")


def _tree(e: dict[str, np.ndarray], n: int) -> int:
    """Parents come first and are directories; each directory's children are a range after it
    that holds exactly the entries naming it as parent; the ranges cover every entry once (the
    count of listed children is returned for `check_children`)."""
    parent, kind, first, count = e["parent"], e["kind"], e["first"], e["count"]
    total = 0
    for a, z in _chunks(0, n):
        idx = np.arange(a, z, dtype=np.uint64)
        if a == 0:
            idx, p = idx[1:], parent[1:z]
        else:
            p = parent[a:z]
        bad = (p >= idx) | (kind[np.minimum(p, n - 1)] != KIND_DIR)
        _fail_at(bad, max(a, 1), "entry {i} has a bad parent (cycle or non-directory)")
        is_dir = kind[a:z] == KIND_DIR
        f, c = first[a:z], count[a:z].astype(np.uint64)
        here = np.arange(a, z, dtype=np.uint64)
        bad = is_dir & (c > 0) & ((f <= here) | (f > n) | (c > np.uint64(n) - np.minimum(f, n)))
        _fail_at(bad, a, "directory entry {i} has children out of range (cycle?)")
        total += int(c[is_dir].sum())
    for a, z in _chunks(1, n):
        p = parent[a:z]
        j = np.arange(a, z, dtype=np.uint64)
        f = first[p]
        bad = (j < f) | (j >= f + count[p])
        _fail_at(bad, a, "entry {i} is not in its parent directory's listing")
    return total


def _names(off: np.ndarray, names: np.ndarray, n: int) -> None:
    if len(names):
        for a, z in _chunks(0, len(names)):
            h = names[a:z]
            pos = _first((h == ord("/")) | (h == 0), a)
            if pos is not None:
                i = int(np.searchsorted(off, pos, side="right")) - 1
                raise FormatError(f"entry {i} has an unsafe name (contains / or NUL)")
    for a, z in _chunks(1, n):
        s, ln = off[a:z], off[a + 1 : z + 1] - off[a:z]
        _fail_at((ln == 0) | (ln > MAX_NAME), a, "entry {i} has an unsafe name (length)")
        dot = ln <= 2
        if dot.any():
            s1 = s[dot]
            b0 = names[s1] == ord(".")
            b1 = np.where(ln[dot] == 2, names[np.minimum(s1 + 1, len(names) - 1)] == ord("."), True)
            bad = np.zeros(z - a, dtype=bool)
            bad[dot] = b0 & b1
            _fail_at(bad, a, "entry {i} has an unsafe name ('.' or '..')")


# _MASK[r]: the first r bytes of a big-endian u64 kept, the rest zeroed.
_MASK = np.array([((1 << 64) - 1) ^ ((1 << (64 - 8 * r)) - 1) for r in range(9)], dtype=np.uint64)


def _words(heap: np.ndarray) -> np.ndarray:
    """`w[i]` = bytes i..i+8 of `heap` as a big-endian u64 (a strided view over a zero-padded
    copy: one gather per 8-byte key instead of eight)."""
    padded = np.zeros(len(heap) + 8, dtype=np.uint8)
    padded[: len(heap)] = heap
    return np.ndarray((len(heap) + 1,), dtype=">u8", buffer=padded, strides=(1,))


def _sorted(parent: np.ndarray, off: np.ndarray, names: np.ndarray, n: int) -> None:
    """Adjacent siblings strictly increase by name bytes (8 bytes compared per round, over the
    names of one chunk of entries at a time)."""
    for a, z in _chunks(1, n - 1):
        base = int(off[a])
        w = _words(names[base : int(off[z + 1])])
        offs = off[a : z + 2].astype(np.int64) - base
        j = np.flatnonzero(parent[a:z] == parent[a + 1 : z + 1])
        sa, ea, eb = offs[j], offs[j + 1], offs[j + 2]
        sb = ea
        pos = 0
        while len(j):
            ka = w[sa + pos] & _MASK[np.clip(ea - sa - pos, 0, 8)]
            kb = w[sb + pos] & _MASK[np.clip(eb - sb - pos, 0, 8)]
            bad = _first(ka > kb)
            if bad is not None:
                raise FormatError(f"directory {int(parent[a + j[bad]])} has unsorted names "
                                  f"at entry {a + j[bad]}")
            tie = ka == kb
            done = tie & (sa + pos + 8 >= ea) & (sb + pos + 8 >= eb)
            if done.any():
                d = a + int(j[_first(done)])
                raise FormatError(f"directory {int(parent[d])} has duplicate names at entry {d}")
            j, sa, ea, sb, eb = j[tie], sa[tie], ea[tie], sb[tie], eb[tie]
            pos += 8


def _blobs(m: Manifest, b: dict[str, np.ndarray], chunk: int, nb: int) -> None:
    nparts = len(m.partitions)
    psize = np.array([p.size for p in m.partitions] or [0], dtype=np.uint64)
    for a, z in _chunks(0, nb):
        part, off = b["part"][a:z], b["offset"][a:z]
        st, raw, cod = b["stored"][a:z].astype(np.uint64), b["raw"][a:z], b["codec"][a:z]
        i = _first(part >= nparts, a)
        if i is not None:
            raise FormatError(f"blob {i} names partition {int(b['part'][i])} of {nparts}")
        _fail_at(raw > chunk, a, "blob {i} raw size exceeds the chunk size")
        top = CODEC_FRAMED if m.version >= 3 else CODEC_ZSTD_DICT  # framed blobs: version 3
        _fail_at(cod > top, a, "blob {i} has an unknown codec")
        _fail_at(raw == 0, a, "blob {i} is empty (an empty file has no blobs)")
        # stored vs raw, by codec: raw equal; zstd 1 .. raw - 1 (kept only when smaller)
        _fail_at((cod == CODEC_RAW) & (st != raw), a, "raw blob {i} stored size differs from raw size")
        zstd = (cod == CODEC_ZSTD) | (cod == CODEC_ZSTD_DICT)
        _fail_at(zstd & ((st == 0) | (st >= raw)), a,
                 "zstd blob {i} stored size is not between 1 and its raw size - 1 "
                 "(prep keeps a frame only when it is smaller)")
        framed = np.flatnonzero(cod == CODEC_FRAMED)
        if len(framed):  # its table and frames of MIN_FRAME at least, none stored larger
            sf, rf = st[framed], raw[framed].astype(np.uint64)
            top_framed = rf + np.uint64(FRAME_HEAD) + np.uint64(FRAME_ENTRY) * (
                (rf + np.uint64(MIN_FRAME - 1)) // np.uint64(MIN_FRAME))
            for bad, what in ((sf < _FRAMED_MIN, "is too short for its frame table"),
                              (sf > top_framed, "stored size exceeds its raw size and largest "
                                                "frame table")):
                k = _first(bad)
                if k is not None:
                    raise FormatError(f"framed blob {a + int(framed[k])} {what}")
        if not m.zdict:
            _fail_at(cod == CODEC_ZSTD_DICT, a, "blob {i} needs a dictionary the manifest lacks")
        ps = psize[np.minimum(part, max(nparts - 1, 0))]
        _fail_at((off < PARTITION_DATA_START) | (off > ps) | (st > ps - np.minimum(off, ps)), a,
                 "blob {i} lies outside its partition")


def _files(e: dict[str, np.ndarray], raw: np.ndarray, chunk: int, n: int, nb: int) -> None:
    """Files' blob ranges tile the blob table in entry order; each file's blobs sum to its size;
    every blob but a file's last holds exactly `chunk` raw bytes."""
    kind, first, count, size = e["kind"], e["first"], e["count"], e["size"]
    nxt = -1  # the blob the next file must start at (found when the share's first chunk comes)
    done = np.uint64(0)  # raw bytes of blobs from the share's first one to `nxt` (differences only)
    for a, z in _chunks(0, n):
        if nxt < 0:
            nxt = _file_end_before(kind, first, count, a)
        f = np.flatnonzero(kind[a:z] == KIND_FILE) + a
        if not len(f):
            continue
        b0, c = first[f], count[f].astype(np.uint64)
        bad = _first((b0 > nb) | (c > np.uint64(nb) - np.minimum(b0, nb)))
        if bad is not None:
            raise FormatError(f"file entry {int(f[bad])} names blobs beyond the blob table")
        ends = b0 + c
        starts = np.concatenate(([np.uint64(nxt)], ends[:-1]))
        bad = _first(b0 != starts)
        if bad is not None:
            raise FormatError(f"file entry {int(f[bad])}: its blobs do not follow the previous "
                              "file's (blob ranges must tile the blob table)")
        end = int(ends[-1])
        r = raw[nxt:end]
        short = r != chunk  # a blob of fewer raw bytes than the chunk size must end its file
        if short.any():
            short[(ends[c > 0] - np.uint64(nxt + 1)).astype(np.int64)] = False
            bad = _first(short)
            if bad is not None:
                i = int(f[np.searchsorted(ends, np.uint64(nxt + bad), side="right")])
                raise FormatError(f"file entry {i}: blob {nxt + bad} holds {int(r[bad])} raw "
                                  f"bytes; every blob but a file's last holds the chunk size "
                                  f"{chunk}")
        csum = np.concatenate(([done], done + np.cumsum(r, dtype=np.uint64)))
        got = csum[(ends - np.uint64(nxt)).astype(np.int64)] - csum[(b0 - np.uint64(nxt)).astype(np.int64)]
        bad = _first(got != size[f])
        if bad is not None:
            i = int(f[bad])
            raise FormatError(f"file entry {i}: size {int(size[i])} does not match its blobs")
        nxt, done = end, csum[-1]
    if _owns_last(0, n):
        nxt = _file_end_before(kind, first, count, n) if nxt < 0 else nxt
        if nxt != nb:
            raise FormatError(f"blobs {nxt}..{nb - 1} belong to no file")


def _file_end_before(kind: np.ndarray, first: np.ndarray, count: np.ndarray, a: int) -> int:
    """Where the blobs of the last file entry before entry `a` end (0: no file before it). Its
    own range is checked by the share that holds it; a share starting after it continues there."""
    for z in range(a, 0, -CHUNK):
        f = np.flatnonzero(kind[max(0, z - CHUNK) : z] == KIND_FILE)
        if len(f):
            i = max(0, z - CHUNK) + int(f[-1])
            return min(int(first[i]) + int(count[i]), 1 << 63)
    return 0


def _links(e: dict[str, np.ndarray], heap: int, n: int) -> None:
    kind, first, size, count = e["kind"], e["first"], e["size"], e["count"]
    for a, z in _chunks(0, n):
        is_link = kind[a:z] == KIND_LINK
        f, s = first[a:z], size[a:z]
        bad = is_link & ((s == 0) | (s > MAX_LINK) | (f > heap) | (s > np.uint64(heap) - np.minimum(f, heap)))
        _fail_at(bad, a, "symlink entry {i} target out of range")
        _fail_at(is_link & (count[a:z] != 0), a, "symlink entry {i} has a count (must be 0)")
