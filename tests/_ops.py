"""Calling pyfuse3 handlers in process: a stand-in request context and small helpers."""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace

import pyfuse3
import pytest

from fanstore_fuse._fuse_ops import Operations


@dataclass
class Ctx:
    """Stand-in for pyfuse3.RequestContext."""

    uid: int = os.getuid()
    gid: int = os.getgid()
    pid: int = os.getpid()
    umask: int = 0o022


CTX = Ctx()


def fields(**set_: bool) -> SimpleNamespace:
    """Stand-in for pyfuse3.SetattrFields (whose attributes are read-only)."""
    names = ("update_size", "update_mode", "update_mtime", "update_uid", "update_gid", "update_atime")
    return SimpleNamespace(**{n: set_.get(n, False) for n in names})


async def errno_of(coro) -> int:
    with pytest.raises(pyfuse3.FUSEError) as ei:
        await coro
    return ei.value.errno


async def resolve(ops: Operations, rel: bytes) -> int:
    ino = pyfuse3.ROOT_INODE
    for part in rel.split(b"/"):
        ino = (await ops.lookup(ino, part, CTX)).st_ino
    return ino


async def listdir(ops: Operations, ino: int, replies) -> list[bytes]:
    """Names readdir sends for a directory (`replies`: the conftest fixture), asked for as the
    kernel does: from where the last request stopped, until one sends nothing."""
    sent, _ = replies
    fh = await ops.opendir(ino, CTX)
    if isinstance(fh, pyfuse3.FileInfo):  # the patched pyfuse3: a listing the kernel may cache
        fh = fh.fh
    names: list[bytes] = []
    pos = 0
    while True:
        sent.clear()
        await ops.readdir(fh, pos, None)
        if not sent:
            return names
        names += [n for n, _, _ in sent]
        pos = sent[-1][2]


async def read_all(ops: Operations, ino: int) -> bytes:
    info = await ops.open(ino, os.O_RDONLY, CTX)
    out = b""
    while chunk := await ops.read(info.fh, len(out), 128 << 10):
        out += chunk
    await ops.release(info.fh)
    return out
