"""`umount --stage-out DIR` on one node saves the written files of every node.

Daemons started one per node (prolog mode) each hold the files written on their own node, and
`umount` on one node reaches only that node's daemon. So the `umount` command asks its local
daemon (a request file next to the mount's state file, then SIGUSR1); that daemon sends
OP_STAGE_OUT to every rank on another host, each of which stages out its own committed files
(verified copies, exactly as `umount` does; nothing local is removed) and answers a summary;
the local daemon writes the answers to a result file the command is waiting for. Files still
open for writing are reported, not copied. A rank that does not answer is reported with what
to run on its node instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from ._errors import FanstoreError
from ._messages import OP_PING, OP_STAGE_OUT, Frame, HandlerTable, ProtocolError, pack, unpack
from ._mountctl import MountState, pid_alive, state_dir
from .writes import WRITES_DIR

REMOTE_TIMEOUT = 3600.0  # a node may have a lot to copy
PING_TIMEOUT = 10.0


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
    # The journal is replayed read-only from disk, so the live store is not touched.
    return stage_out(local_dir, out, unclosed_is_failure=False).as_dict()


async def serve_requests(key: str, others: list[int], hosts: list[str], transport: Any) -> None:
    """On SIGUSR1, run the request in `<key>.stageout-req` (ask the ranks `others`, those whose
    files are not in this node's state) and write `<key>.stageout-res`."""
    req_path, res_path = _paths(key)
    with trio.open_signal_receiver(signal.SIGUSR1) as signals:
        async for _ in signals:
            try:
                with open(req_path) as f:
                    req = json.load(f)
                out, token = str(req["dir"]), str(req["token"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            results = await _ask_all(others, hosts, out, transport)
            _write_json(res_path, {"token": token, "results": results})


async def _ask_all(others: list[int], hosts: list[str], out: str, transport: Any) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []

    async def one(r: int) -> None:
        try:
            # A quick ping first: a dead node is reported in seconds, not after REMOTE_TIMEOUT.
            await transport.request(r, Frame(OP_PING, 0), PING_TIMEOUT)
            resp = await transport.request(r, Frame(OP_STAGE_OUT, 0, body=pack(out)), REMOTE_TIMEOUT)
            results.append(unpack(resp.body))
        except FanstoreError as e:
            results.append({"rank": r, "host": hosts[r], "ok": False, "error": str(e)})

    async with trio.open_nursery() as n:
        for r in others:
            n.start_soon(one, r)
    return sorted(results, key=lambda d: int(d.get("rank", 0)))


# ------------------------------------------------------------------ command side


def needed(st: MountState) -> bool:
    """Whether ranks of this mount run elsewhere (their files are not in this node's state)."""
    return st.ranks > len(st.pids)


def request(st: MountState, out_dir: str, timeout: float = REMOTE_TIMEOUT) -> list[dict[str, Any]]:
    """Ask the ranks on other hosts to stage out into `out_dir`; their summaries, by rank."""
    pid = st.pids[0] if st.pids else 0
    if not pid_alive(pid):
        raise FanstoreError(
            "this node's daemon is gone, so the other nodes cannot be asked: run `fanstore-fuse "
            f"umount {st.template} --stage-out {out_dir}` on each node (the SLURM epilog does)")
    req_path, res_path = _paths(st.key)
    token = uuid.uuid4().hex
    with contextlib.suppress(FileNotFoundError):
        os.unlink(res_path)
    _write_json(req_path, {"dir": os.path.abspath(out_dir), "token": token})
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
        raise FanstoreError(f"the other nodes did not finish staging out within {timeout:g} s")
    finally:
        for p in (req_path, res_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)


def describe(result: dict[str, Any], template: str, out_dir: str) -> list[str]:
    """Lines for one rank's answer, saying what to do where something was not saved."""
    who = f"rank {result.get('rank')} on {result.get('host')}"
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
