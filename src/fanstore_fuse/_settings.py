"""Every environment setting of fanstore-fuse: one `Settings` object, one row each in the
README's tuning table. Anything else a daemon could tune is a constant in its module, with a
comment that says why the value.

| variable | default | what |
|---|---|---|
| `FANSTORE_STATE_DIR` | `$XDG_RUNTIME_DIR/fanstore-fuse` | per-user mount state (pids, mountpoints) |
| `FANSTORE_CACHE_BYTES` | 256 MiB | decoded blobs kept in the daemon's memory (`BlobCache`) |
| `FANSTORE_CACHE_SIZE` | 50% | disk cache of remote blobs (`--cache-size`): `10G`, `50%` of free, `0` off |
| `FANSTORE_READAHEAD_CHUNKS` | 4 | chunks fetched ahead of a sequential reader |
| `FANSTORE_STARTUP_TIMEOUT` | 120 | seconds a multi-rank start may take before `mount` fails |
| `FANSTORE_PROLOG_TIMEOUT` | 300 | seconds a Slurm prolog mount may take |
| `FANSTORE_JOB_DIR` | `/var/lib/fanstore-fuse/jobs` | prolog mode: root's job records |
| `FANSTORE_RENDEZVOUS_DIR` | (none) | prolog mode: shared dir where node daemons meet |
| `FANSTORE_MOUNT_BASE` | `/tmp` | prolog mode: where the job's mountpoint is made |
| `FANSTORE_LOCAL_BASE` | `/tmp` | prolog mode: where the node-local copy is made |
| `FANSTORE_MPIEXEC` | (found) | the `mpiexec` of `mount --ranks` (by default the MPI library's own) |
| `FANSTORE_SRUN_MPI` | (found) | `srun --mpi` plugin in a Slurm job (default: pmix for Open MPI, else pmi2) |
| `FANSTORE_TENSORIO_TOOL` | (measured) | tensor I/O: force one transfer tool |
| `FANSTORE_TENSORIO_DB` | `~/.cache/...` | tensor I/O: the selector's measurements |

The daemon builds one `Settings` (`Settings.from_env()`) and hands it to what it composes;
library code never reads the environment for these. The launcher, prolog and tensor I/O read
their own rows where they run (`_launch`, `_slurmjob`, `tensorio`) under the names listed here
(`ENV`); `tests/test_node.py` checks that src/ names no other. A bad value is a one-line error.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from ._errors import FanstoreError

ENV = {
    "state_dir": "FANSTORE_STATE_DIR",
    "cache_bytes": "FANSTORE_CACHE_BYTES",
    "cache_size": "FANSTORE_CACHE_SIZE",
    "readahead_chunks": "FANSTORE_READAHEAD_CHUNKS",
    "startup_timeout": "FANSTORE_STARTUP_TIMEOUT",
    "prolog_timeout": "FANSTORE_PROLOG_TIMEOUT",
    "job_dir": "FANSTORE_JOB_DIR",
    "rendezvous_dir": "FANSTORE_RENDEZVOUS_DIR",
    "mount_base": "FANSTORE_MOUNT_BASE",
    "local_base": "FANSTORE_LOCAL_BASE",
    "mpiexec": "FANSTORE_MPIEXEC",
    "srun_mpi": "FANSTORE_SRUN_MPI",
    "tensorio_tool": "FANSTORE_TENSORIO_TOOL",
    "tensorio_db": "FANSTORE_TENSORIO_DB",
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
    state_dir: str = ""  # empty: `_mountctl.default_state_dir()`
    cache_bytes: int = 256 << 20
    cache_size: str = "50%"
    readahead_chunks: int = 4
    startup_timeout: float = 120.0
    prolog_timeout: float = 300.0
    job_dir: str = ""
    rendezvous_dir: str = ""
    mount_base: str = "/tmp"
    local_base: str = "/tmp"
    mpiexec: str = ""
    srun_mpi: str = ""
    tensorio_tool: str = ""
    tensorio_db: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        values: dict[str, int | float | str] = {}
        for f in fields(cls):
            name = ENV[f.name]
            raw = env.get(name)
            if raw is None or raw == "":
                continue
            if f.type in (str, "str"):
                if f.name == "cache_size":  # a bad size fails here, in one line
                    try:
                        parse_cache_size(raw)
                    except FanstoreError as e:
                        raise FanstoreError(f"{name}={raw!r}: {e}") from None
                values[f.name] = raw
                continue
            kind = int if f.type in (int, "int") else float
            try:
                value = kind(raw)
            except ValueError:
                what = "an integer" if kind is int else "a number"
                raise FanstoreError(f"{name}={raw!r} is not {what}") from None
            if value < 0:
                raise FanstoreError(f"{name}={raw!r} must not be negative")
            values[f.name] = value
        return cls(**values)  # type: ignore[arg-type]
