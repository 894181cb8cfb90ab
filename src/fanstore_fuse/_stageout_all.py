"""`umount [--stage-out DIR]` on one node ends the mount on every node.

Daemons started one per node (job-script or prolog mode) each hold the files written on their
own node, and `umount` on one node reaches only that node's daemon. So the `umount` command asks
its local daemon (a request file next to the mount's state file, then SIGUSR1); that daemon
sends the request to every rank on another host over MPI and writes their answers to a result
file the command is waiting for:

- OP_STAGE_OUT (with `--stage-out DIR`): each rank stages out its own committed files (verified
  copies, exactly as `umount` does) and answers a summary; a rank that saved every written file
  marks its local dir saved (`_mountctl.mark_saved`). Files still open for writing are reported,
  not copied.
- OP_STOP, after that: each rank answers, then unmounts and ends; its teardown removes its
  local dir unless it holds written files that were not saved (those stay, for `recover` or the
  SLURM epilog).

A rank that does not answer is reported with what to run on its node instead.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from ._errors import FanstoreError
from ._messages import (
    OP_PING,
    OP_STAGE_OUT,
    OP_STOP,
    Frame,
    HandlerTable,
    ProtocolError,
    pack,
    unpack,
)
from ._mountctl import MountState, mark_saved, pid_alive, state_dir, writes_fingerprint
from .writes import WRITES_DIR

log = logging.getLogger("fanstore_fuse.stageout")

REMOTE_TIMEOUT = 3600.0  # a node may have a lot to copy
PING_TIMEOUT = 10.0
STOP_TIMEOUT = 10.0  # a rank answers OP_STOP at once, then unmounts
REPLY_GRACE = 0.2  # seconds a stopping rank keeps serving so that its answer goes out


def _paths(key: str) -> tuple[str, str]:
    base = os.path.join(state_dir(), key)
    return base + ".stageout-req", base + ".stageout-res"


def _write_json(path: str, obj: object) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


# ------------------------------------------------------------------ daemon side


def register(table: HandlerTable, rank: int, local_dir: str,
             commit: Callable[[], Awaitable[None]] | None = None) -> None:
    """Serve OP_STAGE_OUT: stage this rank's committed written files into the asked dir, after
    `commit` (files written without OPEN: their handles closed, which commits them)."""

    async def handle(src: int, req: Frame) -> Frame:
        out = unpack(req.body)
        if not isinstance(out, str) or not os.path.isabs(out):
            raise ProtocolError("stage-out needs an absolute directory")
        if commit is not None:
            await commit()
        summary = await trio.to_thread.run_sync(_stage_local, local_dir, out)
        summary.update(rank=rank, host=socket.gethostname(), local=local_dir)
        return Frame(req.op, req.req_id, body=pack(summary))

    table.register(OP_STAGE_OUT, handle)


def _stage_local(local_dir: str, out: str) -> dict[str, Any]:
    from ._stageout import stage_out

    if not os.path.exists(os.path.join(local_dir, WRITES_DIR)):
        return {"files": 0, "bytes": 0, "ok": True, "failures": [], "unclosed": []}
    before = writes_fingerprint(local_dir)  # a write during the copy leaves it unsaved
    # The journal is replayed read-only from disk, so the live store is not touched.
    summary = stage_out(local_dir, out, unclosed_is_failure=False)
    if summary.ok and not summary.unclosed:
        mark_saved(local_dir, out, before)
    return summary.as_dict()


class StopRequest:
    """OP_STOP from another rank: `wait` (a side task of the daemon) returns once it came, a
    moment after the answer was handed to the transport, and the daemon then unmounts."""

    def __init__(self) -> None:
        self.asked_by: int | None = None
        self._event: trio.Event | None = None

    def register(self, table: HandlerTable) -> None:
        table.register(OP_STOP, self._handle)

    async def _handle(self, src: int, req: Frame) -> Frame:
        self.asked_by = src
        if self._event is not None:
            self._event.set()
        return Frame(req.op, req.req_id)

    async def wait(self, then: Callable[[], None]) -> None:
        self._event = trio.Event()
        if self.asked_by is None:
            await self._event.wait()
        await trio.sleep(REPLY_GRACE)
        log.info("rank %s ended the mount everywhere (umount): unmounting", self.asked_by)
        then()


async def serve_requests(key: str, others: list[int], hosts: list[str], transport: Any,
                         writable: bool = True) -> None:
    """On SIGUSR1, run the request in `<key>.stageout-req` (ask the ranks `others`, those whose
    files are not in this node's state, to stage out or to stop) and write `<key>.stageout-res`."""
    req_path, res_path = _paths(key)
    with trio.open_signal_receiver(signal.SIGUSR1) as signals:
        async for _ in signals:
            try:
                with open(req_path) as f:
                    req = json.load(f)
                token = str(req["token"])
                out = str(req.get("dir", ""))
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if req.get("stop"):
                results = await _stop_all(others, hosts, transport)
            elif writable:
                results = await _ask_all(others, hosts, out, transport)
            else:  # a read-only mount: nothing was written anywhere
                results = [{"rank": r, "host": hosts[r], "ok": True, "files": 0, "bytes": 0}
                           for r in others]
            _write_json(res_path, {"token": token, "results": results})


async def _ask_each(others: list[int], hosts: list[str], transport: Any, op: int, body: bytes,
                    timeout: float, answer: Callable[[int, Frame], dict[str, Any]]
                    ) -> list[dict[str, Any]]:
    """Send `op` to every rank in `others` at once and collect `answer(rank, reply)`, or an
    error line per rank. A quick ping first: a dead node is reported in seconds, not after
    `timeout`."""
    results: list[dict[str, Any]] = []

    async def one(r: int) -> None:
        try:
            await transport.request(r, Frame(OP_PING, 0), PING_TIMEOUT)
            results.append(answer(r, await transport.request(r, Frame(op, 0, body=body), timeout)))
        except FanstoreError as e:
            results.append({"rank": r, "host": hosts[r], "ok": False, "error": str(e)})

    async with trio.open_nursery() as n:
        for r in others:
            n.start_soon(one, r)
    return sorted(results, key=lambda d: int(d.get("rank", 0)))


async def _stop_all(others: list[int], hosts: list[str], transport: Any) -> list[dict[str, Any]]:
    return await _ask_each(others, hosts, transport, OP_STOP, b"", STOP_TIMEOUT,
                           lambda r, _: {"rank": r, "host": hosts[r], "ok": True, "stopping": True})


async def _ask_all(others: list[int], hosts: list[str], out: str, transport: Any) -> list[dict[str, Any]]:
    return await _ask_each(others, hosts, transport, OP_STAGE_OUT, pack(out), REMOTE_TIMEOUT,
                           lambda _, resp: unpack(resp.body))


# ------------------------------------------------------------------ command side


def needed(st: MountState) -> bool:
    """Whether ranks of this mount run elsewhere (their files are not in this node's state)."""
    return st.ranks > len(st.pids)


def request(st: MountState, out_dir: str, timeout: float = REMOTE_TIMEOUT) -> list[dict[str, Any]]:
    """Ask the ranks on other hosts to stage out into `out_dir`; their summaries, by rank."""
    how = f"umount {st.template} --stage-out {out_dir}"
    return _ask_daemon(st, {"dir": os.path.abspath(out_dir)}, how, timeout)


def stop_others(st: MountState, timeout: float = PING_TIMEOUT + STOP_TIMEOUT + 30) -> list[dict[str, Any]]:
    """Ask the ranks on other hosts to unmount and end; their answers, by rank."""
    return _ask_daemon(st, {"stop": True}, f"umount {st.template}", timeout)


def _ask_daemon(st: MountState, req: dict[str, Any], how: str, timeout: float) -> list[dict[str, Any]]:
    pid = st.pids[0] if st.pids else 0
    if not pid_alive(pid):
        raise FanstoreError(
            "this node's daemon is gone, so the other nodes cannot be asked: run `fanstore-fuse "
            f"{how}` on each node (the SLURM epilog does)")
    req_path, res_path = _paths(st.key)
    token = uuid.uuid4().hex
    with contextlib.suppress(FileNotFoundError):
        os.unlink(res_path)
    _write_json(req_path, {**req, "token": token})
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                with open(res_path) as f:
                    res = json.load(f)
                if res.get("token") == token:
                    return list(res["results"])
            if not pid_alive(pid):
                raise FanstoreError("this node's daemon exited before the other nodes answered")
            time.sleep(0.1)
        raise FanstoreError(f"the other nodes did not answer within {timeout:g} s")
    finally:
        for p in (req_path, res_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)


def describe(result: dict[str, Any], template: str, out_dir: str) -> list[str]:
    """Lines for one rank's answer, saying what to do where something was not saved."""
    who = f"rank {result.get('rank')} on {result.get('host')}"
    if result.get("stopping"):
        return [f"{who}: unmounting"]
    if result.get("error") and not out_dir:
        return [f"{who}: not reached ({result['error']}); on that node run `fanstore-fuse umount "
                f"{template}`"]
    if result.get("error"):
        return [f"{who}: not reached ({result['error']}); on that node run `fanstore-fuse umount "
                f"{template} --stage-out {out_dir}`, or `fanstore-fuse recover LOCAL_DIR "
                f"--stage-out {out_dir}` if its daemon died"]
    lines = [f"{who}: staged out {result.get('files', 0)} files, {result.get('bytes', 0)} bytes"]
    for f in result.get("failures", []):
        lines.append(f"{who}: not saved: {f.get('path')!r}: {f.get('reason')} "
                     f"(kept in {f.get('local') or result.get('local')})")
    for u in result.get("unclosed", []):
        lines.append(f"{who}: still open for writing, not copied: {u.get('path')!r}")
    return lines
