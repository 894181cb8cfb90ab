"""The write journal: an append-only file of checksummed msgpack records, and the directory
layout of a write store.

Layout under ``LOCAL/writes/`` (`WRITES_DIR`)::

    journal.fwj          header (magic, version) + records: length u32, xxh3-64 u64, msgpack body
    data/<k:016x>        the bytes of written file k (stable ids: user names never touch disk)

A torn or corrupt record ends the replay with a warning (the records before it stand); opening
for append cuts such a tail off so new records follow good ones.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import struct
import threading
from collections.abc import Iterator
from typing import Any

import msgpack

from .._errors import FormatError, os_error
from .._format import checksum

log = logging.getLogger("fanstore_fuse.writes")

WRITES_DIR = "writes"  # under a rank's local dir
DATA_DIR = "data"  # under WRITES_DIR
JOURNAL_NAME = "journal.fwj"
JOURNAL_MAGIC = b"FSTRWJNL"
JOURNAL_VERSION = 2  # 2: a commit's "h" is the xxh3 of its chunk digests ("c"), not of the bytes
_READS = (1, 2)  # version 1 is read too: its digests are taken from "c" (see WriteStore._apply)
_JHEADER = struct.Struct("<8sHHI")  # magic, version, flags, reserved (16 bytes)
_RHEADER = struct.Struct("<IQ")  # payload length, xxh3-64 of the payload
MAX_RECORD = 16 << 20


def has_records(local_dir: str) -> bool:
    """Whether a local dir's journal records anything (a written entry, even a lone directory)."""
    try:
        return os.path.getsize(os.path.join(local_dir, WRITES_DIR, JOURNAL_NAME)) > _JHEADER.size
    except OSError:
        return False


class Journal:
    """Append-only, checksummed msgpack records; see the module docstring."""

    def __init__(self, path: str, readonly: bool = False):
        self.path = path
        self.readonly = readonly
        self.warnings: list[str] = []
        self.fd = -1
        self.end = 0
        self.version = JOURNAL_VERSION  # the version read (appends make it JOURNAL_VERSION)
        self._synced = 0  # the journal is durable up to here
        self._sync_lock = threading.Lock()

    def replay(self) -> Iterator[dict[str, Any]]:
        """Yield the valid records; stop (with a warning) at the first torn or corrupt one."""
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self.end = 0
            return
        if len(data) < _JHEADER.size:
            if data:
                self.warn(f"journal {self.path} has a truncated header; starting empty")
            self.end = 0
            return
        magic, version, flags, reserved = _JHEADER.unpack_from(data)
        if magic != JOURNAL_MAGIC:
            raise FormatError(f"{self.path} is not a fanstore-fuse write journal (bad magic)")
        if version not in _READS or flags or reserved:
            raise FormatError(f"{self.path}: journal version {version} flags {flags:#x} unsupported")
        self.version = version
        off = _JHEADER.size
        n = 0
        while off < len(data):
            if off + _RHEADER.size > len(data):
                self.warn(f"journal record {n} at offset {off} is torn (short header); ignored")
                break
            length, digest = _RHEADER.unpack_from(data, off)
            body = data[off + _RHEADER.size : off + _RHEADER.size + length]
            if length > MAX_RECORD or len(body) != length:
                self.warn(f"journal record {n} at offset {off} is torn ({length} bytes); ignored")
                break
            if checksum(body) != digest:
                self.warn(f"journal record {n} at offset {off} fails its checksum; it and later "
                           "records are ignored")
                break
            try:
                rec = msgpack.unpackb(body, raw=False)
            except Exception as e:  # msgpack raises several types
                self.warn(f"journal record {n} at offset {off} does not decode ({e}); ignored")
                break
            off += _RHEADER.size + length
            n += 1
            if isinstance(rec, dict):
                yield rec
            else:
                self.warn(f"journal record {n} is not a map; skipped")
        self.end = off

    def warn(self, msg: str) -> None:
        log.warning("%s", msg)
        self.warnings.append(msg)

    def open_for_append(self) -> None:
        assert not self.readonly
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            size = os.fstat(fd).st_size
            if self.end == 0:
                os.ftruncate(fd, 0)
                os.pwrite(fd, _JHEADER.pack(JOURNAL_MAGIC, JOURNAL_VERSION, 0, 0), 0)
                os.fsync(fd)
                self.end = _JHEADER.size
            elif size > self.end or self.version != JOURNAL_VERSION:
                # drop a torn/corrupt tail so new records follow good ones; an older build's
                # journal (its records read the same) becomes this version's
                os.ftruncate(fd, self.end)
                os.pwrite(fd, _JHEADER.pack(JOURNAL_MAGIC, JOURNAL_VERSION, 0, 0), 0)
                os.fsync(fd)
                self.version = JOURNAL_VERSION
        except OSError as e:
            os.close(fd)
            raise os_error(e, "journal") from None
        self.fd = fd

    def append(self, rec: dict[str, Any], sync: bool) -> None:
        body = msgpack.packb(rec, use_bin_type=True)
        frame = _RHEADER.pack(len(body), checksum(body)) + body
        try:
            n = os.pwrite(self.fd, frame, self.end)
            if n != len(frame):
                raise OSError(errno.ENOSPC, "short write to the journal")
            if sync:
                os.fsync(self.fd)
        except OSError as e:
            # Never leave a torn record that would hide later ones: cut back to the last good one.
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, self.end)
            raise os_error(e, "journal") from None
        self.end += len(frame)

    def sync(self) -> None:
        """Make every record appended so far durable. Callers that come while another's fsync
        runs wait for it and fsync once more only if it did not cover their records (a group
        commit: concurrent commits share fsyncs)."""
        want = self.end
        with self._sync_lock:
            if self._synced >= want:
                return
            upto = self.end
            try:
                os.fsync(self.fd)
            except OSError as e:
                raise os_error(e, "journal") from None
            self._synced = upto

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
