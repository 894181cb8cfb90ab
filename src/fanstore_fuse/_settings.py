"""Tuning knobs of a mount daemon, read from the environment once, when the daemon starts.

| variable | default | what |
|---|---|---|
| `FANSTORE_CACHE_BYTES` | 268435456 (256 MiB) | bytes of decoded blobs a daemon keeps (`BlobCache`) |
| `FANSTORE_THREAD_THRESHOLD` | 262144 (256 KiB) | blobs from this size on are decoded in a worker thread |
| `FANSTORE_READAHEAD_CHUNKS` | 4 | chunks fetched ahead of a sequential reader |
| `FANSTORE_MPI_SPIN` | 0 | `sleep(0)` polls of the MPI thread before it backs off |
| `FANSTORE_MPI_MAX_SLEEP` | 0.001 | longest poll interval (s) of the MPI thread while recently busy |
| `FANSTORE_MPI_SEND_POLL` | 2e-05 | first poll interval (s) while a send is pending |
| `FANSTORE_NOFLUSH` | 1 | writable mount: open read-only files with FOPEN_NOFLUSH (0: flush every close) |
| `FANSTORE_MPI_REPLY_POLL` | 2e-05 | first poll interval (s) while replies are due (0: idle backoff) |
| `FANSTORE_MPI_BACKOFF` | 2.0 | growth of the MPI thread's poll interval while nothing arrives (1: fixed) |
| `FANSTORE_MPI_DOORBELL` | 1 | a UDP doorbell rung with each frame sent wakes the peer (0: poll only) |
| `FANSTORE_MPI_INLINE` | 1 | serve blob requests on the MPI thread (0: as trio tasks, the old path) |

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
    "mpi_inline": "FANSTORE_MPI_INLINE",
    "mpi_backoff": "FANSTORE_MPI_BACKOFF",
    "mpi_doorbell": "FANSTORE_MPI_DOORBELL",
}


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
    mpi_inline: int = 1
    mpi_backoff: float = 2.0
    mpi_doorbell: int = 1

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        values: dict[str, int | float] = {}
        for f in fields(cls):
            raw = env.get(_ENV[f.name])
            if raw is None or raw == "":
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
