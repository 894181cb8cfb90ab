"""Who owns a test cluster: the process whose death ends it (a pytest session, a bench).

`record(pid)` is what `Cluster.start(owner=pid)` keeps in DIR/cluster.json: the pid, its start
time (a reused pid is another process) and its PID namespace (a pid means nothing in another
one). `gone(rec)` is true only when that very process has ended (or is a zombie); a cluster with
no owner, or one recorded in another PID namespace, is never taken for abandoned."""

from __future__ import annotations

import os


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name (state is [0], start time [19]); None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _pid_ns() -> str:
    return os.readlink("/proc/self/ns/pid")


def record(pid: int) -> dict[str, object]:
    fields = _stat_fields(pid)
    if fields is None:
        raise ValueError(f"owner pid {pid} does not run")
    return {"pid": pid, "start": fields[19], "pidns": _pid_ns()}


def gone(rec: dict[str, object] | None) -> bool:
    if not rec or rec.get("pidns") != _pid_ns():
        return False
    fields = _stat_fields(int(rec["pid"]))  # type: ignore[call-overload]
    return fields is None or fields[0] == "Z" or fields[19] != rec["start"]
