"""Tuning knobs of a mount daemon, read from the environment once, when the daemon starts.

| variable | default | what |
|---|---|---|
| `FANSTORE_CACHE_BYTES` | 268435456 (256 MiB) | decoded blobs kept (`BlobCache`; + the last 2 bigger) |
| `FANSTORE_THREAD_THRESHOLD` | 262144 (256 KiB) | blobs from this size on are decoded in a worker thread |
| `FANSTORE_READAHEAD_CHUNKS` | 4 | chunks fetched ahead of a sequential reader |
| `FANSTORE_MPI_SPIN` | 0 | `sleep(0)` polls of the MPI thread before it backs off |
| `FANSTORE_MPI_MAX_SLEEP` | 0.001 | longest poll interval (s) of the MPI thread while recently busy |
| `FANSTORE_MPI_SEND_POLL` | 2e-05 | first poll interval (s) while a send is pending |
| `FANSTORE_NOFLUSH` | 1 | writable mount: open read-only files with FOPEN_NOFLUSH (0: flush every close) |
| `FANSTORE_NO_OPEN` | 1 | files open without OPEN, RELEASE or FLUSH (kernel no_open; C shim; 0: off) |
| `FANSTORE_COMMIT_SHARE` | 0.05 | no_open: idle wait before a commit, at least last hash s / this |
| `FANSTORE_FASTOPEN` | 1 | answer OPEN/RELEASE of dataset files in the C shim (0: in Python) |
| `FANSTORE_FASTREAD` | 1 | answer READ of dataset files held here in the C shim (0: in Python) |
| `FANSTORE_FASTREAD_THREADS` | 16 | the C shim's reader threads |
| `FANSTORE_FASTREAD_INLINE` | 131072 | C READs this small first tried from the page cache inline (0: never) |
| `FANSTORE_FUSE_LINGER_US` | 200 | after a request answered in C, wait for the next (us; 0: back to trio) |
| `FANSTORE_FUSE_TRIO_TOTAL_US` | 5000 | while trio idles, answer in C at most this long before it runs (us) |
| `FANSTORE_FUSE_THREADS` | 1 | C threads reading /dev/fuse for the shim (0: pyfuse3 reads it) |
| `FANSTORE_FUSE_URING` | 0 | 1: FUSE requests over io_uring where the kernel has it (Linux 6.14+) |
| `FANSTORE_MPI_REPLY_POLL` | 2e-05 | first poll interval (s) while replies are due (0: idle backoff) |
| `FANSTORE_MPI_BACKOFF` | 2.0 | growth of the MPI thread's poll interval while nothing arrives (1: fixed) |
| `FANSTORE_MPI_DOORBELL` | 1 | a UDP doorbell rung with each frame sent wakes the peer (0: poll only) |
| `FANSTORE_MPI_BELL_IDLE` | 0.05 | longest idle sleep (s) of the MPI threads with doorbells (else 0.005) |
| `FANSTORE_MPI_INLINE` | 1 | serve blob requests on the MPI thread (0: as trio tasks, the old path) |
| `FANSTORE_CACHE_SIZE` | 50% | disk cache of remote blobs (`--cache-size`): `10G`, `50%` of free, `0` off |
| `FANSTORE_CACHE_C` | 1 | the C shim's READ path reads blobs of the disk cache itself (0: through Python) |
| `FANSTORE_FRAME_CACHE_C` | 1 | the C shim keeps decoded zstd frames, up to `FANSTORE_CACHE_BYTES` (0: off) |
| `FANSTORE_SUBBLOCK_CACHE` | 1 | that cache keeps raw 16 KiB sub-blocks read in part too (0: not) |
| `FANSTORE_FRAME_PUSH` | 1 | frames partly read (buffered) pushed into the kernel's page cache (0: not) |
| `FANSTORE_MPIEXEC` | (found) | the `mpiexec` of `mount --ranks` (`_mpilib`: by default the library's own) |
| `FANSTORE_SRUN_MPI` | (found) | `srun --mpi` plugin in a Slurm job (default: pmix for Open MPI, else pmi2) |

The daemon builds one `Settings` (`Settings.from_env()`) and hands it to what it composes;
library code never reads the environment for these. A bad value is a one-line error.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from ._errors import FanstoreError

_ENV = {
    "cache_bytes": "FANSTORE_CACHE_BYTES",
    "thread_threshold": "FANSTORE_THREAD_THRESHOLD",
    "readahead_chunks": "FANSTORE_READAHEAD_CHUNKS",
    "mpi_spin": "FANSTORE_MPI_SPIN",
    "mpi_max_sleep": "FANSTORE_MPI_MAX_SLEEP",
    "mpi_send_poll": "FANSTORE_MPI_SEND_POLL",
    "mpi_reply_poll": "FANSTORE_MPI_REPLY_POLL",
    "noflush": "FANSTORE_NOFLUSH",
    "no_open": "FANSTORE_NO_OPEN",
    "commit_share": "FANSTORE_COMMIT_SHARE",
    "fast_open": "FANSTORE_FASTOPEN",
    "fuse_linger_us": "FANSTORE_FUSE_LINGER_US",
    "fuse_trio_total_us": "FANSTORE_FUSE_TRIO_TOTAL_US",
    "fuse_threads": "FANSTORE_FUSE_THREADS",
    "fuse_uring": "FANSTORE_FUSE_URING",
    "fast_read": "FANSTORE_FASTREAD",
    "fast_read_threads": "FANSTORE_FASTREAD_THREADS",
    "fast_read_inline": "FANSTORE_FASTREAD_INLINE",
    "mpi_inline": "FANSTORE_MPI_INLINE",
    "mpi_backoff": "FANSTORE_MPI_BACKOFF",
    "mpi_doorbell": "FANSTORE_MPI_DOORBELL",
    "mpi_bell_idle": "FANSTORE_MPI_BELL_IDLE",
    "cache_size": "FANSTORE_CACHE_SIZE",
    "cache_c": "FANSTORE_CACHE_C",
    "frame_cache_c": "FANSTORE_FRAME_CACHE_C",
    "frame_push": "FANSTORE_FRAME_PUSH",
    "subblock_cache": "FANSTORE_SUBBLOCK_CACHE",
    "mpiexec": "FANSTORE_MPIEXEC",
    "srun_mpi": "FANSTORE_SRUN_MPI",
}
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from `123`, `500M`, `10G`, `1.5T` (binary units; `10GiB`, `10GB` too)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = _UNITS.get(t[-1:], 1)
    try:
        value = float(t[:-1] if t[-1:] in _UNITS else t) * mult
    except ValueError:
        raise FanstoreError(f"bad size {text!r} (use e.g. 500M or 10G)") from None
    if not value >= 0 or value == float("inf"):
        raise FanstoreError(f"bad size {text!r} (use e.g. 500M or 10G)")
    return int(value)


def parse_cache_size(text: str) -> tuple[int | None, float | None]:
    """`--cache-size`: (bytes, None) for a size, (None, fraction) for a share of free space."""
    t = text.strip()
    if t.endswith("%"):
        try:
            pct = float(t[:-1])
        except ValueError:
            pct = -1.0
        if not 0 <= pct <= 100:
            raise FanstoreError(f"bad cache size {text!r} (a percentage is 0% to 100%)")
        return None, pct / 100
    return parse_size(t), None


@dataclass(frozen=True)
class Settings:
    cache_bytes: int = 256 << 20
    thread_threshold: int = 256 << 10
    readahead_chunks: int = 4
    mpi_spin: int = 0
    mpi_max_sleep: float = 0.001
    mpi_send_poll: float = 20e-6
    mpi_reply_poll: float = 20e-6
    noflush: int = 1
    no_open: int = 1
    commit_share: float = 0.05
    fast_open: int = 1
    fuse_linger_us: int = 200
    fuse_trio_total_us: int = 5000
    fuse_threads: int = 1
    fuse_uring: int = 0
    fast_read: int = 1
    fast_read_threads: int = 16
    fast_read_inline: int = 128 << 10
    mpi_inline: int = 1
    mpi_backoff: float = 2.0
    mpi_doorbell: int = 1
    mpi_bell_idle: float = 0.05
    cache_size: str = "50%"
    cache_c: int = 1
    frame_cache_c: int = 1
    frame_push: int = 1
    subblock_cache: int = 1
    mpiexec: str = ""
    srun_mpi: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        values: dict[str, int | float | str] = {}
        for f in fields(cls):
            raw = env.get(_ENV[f.name])
            if raw is None or raw == "":
                continue
            if f.type in (str, "str"):
                if f.name != "cache_size":
                    values[f.name] = raw
                    continue
                try:  # a bad size fails here, in one line
                    parse_cache_size(raw)
                except FanstoreError as e:
                    raise FanstoreError(f"{_ENV[f.name]}={raw!r}: {e}") from None
                values[f.name] = raw
                continue
            kind = int if f.type in (int, "int") else float
            try:
                value = kind(raw)
            except ValueError:
                what = "an integer" if kind is int else "a number"
                raise FanstoreError(f"{_ENV[f.name]}={raw!r} is not {what}") from None
            if value < 0:
                raise FanstoreError(f"{_ENV[f.name]}={raw!r} must not be negative")
            values[f.name] = value
        return cls(**values)  # type: ignore[arg-type]
