"""One MPI communicator out of daemons started independently, one `mpiexec -n 1` per node.

In prolog mode every node's daemon is started by that node's own prolog, with no `srun` and
no shared MPI world. They meet through a directory on the shared file system:

- node index 0 opens an MPI port (`MPI.Open_port`) and publishes its name in `port` (written
  to a temporary name, then renamed: a reader never sees half a name);
- every other node reads the port name and `Connect`s; the group so far `Accept`s the
  newcomers one at a time (collectively) and `Merge`s each intercommunicator, until the group
  has `nodes` members;
- a final `Split` with key = node index orders the ranks as the job's node list does, so
  placement (which blobs a rank holds) is the same on every node, whatever the arrival order.

Every process also drops `arrived-<index>` into the directory, so a time-out can name the
nodes that never came. MPI's connect/accept calls cannot be interrupted: a watchdog thread
reports the time-out through `on_timeout` and ends the process (`os._exit`), so nothing
half-joined survives; the others, blocked in the same collective `Accept`, hit their own
deadlines the same way. Bare singletons (a daemon started without `mpiexec`) cannot join
("Local and remote groups in MPI_Intercomm_create must not overlap"): start each with
`mpiexec -n 1`. Open MPI joins separate `mpiexec` runs only through an `ompi-server` given to
each of them (`_launch` starts one on node 0); without one `_mpilib.join_problem` refuses
before anything starts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._errors import FanstoreError

log = logging.getLogger("fanstore_fuse.rendezvous")

PORT_FILE = "port"
ARRIVED = "arrived-"


@dataclass
class Rendezvous:
    directory: str  # shared by every node of the job
    index: int  # this node's index in the job's node list
    nodes: int  # how many nodes the group has in the end
    timeout: float = 120.0

    def check(self) -> None:
        if self.nodes < 1:
            raise FanstoreError(f"rendezvous: {self.nodes} nodes (need at least 1)")
        if not 0 <= self.index < self.nodes:
            raise FanstoreError(f"rendezvous: node index {self.index} not in 0..{self.nodes - 1}")
        if not os.path.isdir(self.directory):
            raise FanstoreError(f"rendezvous directory {self.directory} does not exist")

    def missing(self) -> list[int]:
        """Node indexes that never showed up in the directory."""
        try:
            here = set(os.listdir(self.directory))
        except OSError:
            return list(range(self.nodes))
        return [i for i in range(self.nodes) if f"{ARRIVED}{i}" not in here]


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_port(rv: Rendezvous, deadline: float) -> str:
    path = os.path.join(rv.directory, PORT_FILE)
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            with open(path) as f:
                name = f.read().strip()
            if name:
                return name
        time.sleep(0.05)
    raise TimeoutError


class _Watchdog:
    """Ends the process when the join is not done by the deadline (MPI calls cannot be
    interrupted), after telling `on_timeout` why."""

    def __init__(self, rv: Rendezvous, on_timeout: Callable[[str], None]):
        self.rv = rv
        self.on_timeout = on_timeout
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="fanstore-rendezvous", daemon=True)

    def _run(self) -> None:
        if self.done.wait(self.rv.timeout):
            return
        missing = self.rv.missing()
        why = (f"node(s) {', '.join(map(str, missing))} never arrived" if missing
               else "every node arrived but the MPI connection was not completed")
        msg = (f"rendezvous in {self.rv.directory} timed out after {self.rv.timeout:g} s: "
               f"{why} (node {self.rv.index} of {self.rv.nodes})")
        log.error("%s", msg)
        try:
            self.on_timeout(msg)
        finally:
            os._exit(3)


def join(rv: Rendezvous, on_timeout: Callable[[str], None]) -> Any:
    """The ordered communicator of all `rv.nodes` daemons (this one is rank `rv.index`).

    Raises FanstoreError on a bad setting; on a time-out, calls `on_timeout(message)` and
    ends the process (see the module docstring).
    """
    from mpi4py import MPI

    from ._transport import unlink_shared_segments

    unlink_shared_segments()  # this process's own MPI_Init (a singleton): nobody else attaches
    rv.check()
    if rv.nodes == 1:
        return MPI.COMM_SELF.Dup()
    dog = _Watchdog(rv, on_timeout)
    dog.thread.start()
    deadline = time.monotonic() + rv.timeout
    port_path = os.path.join(rv.directory, PORT_FILE)
    t0 = time.monotonic()
    try:
        _write_atomic(os.path.join(rv.directory, f"{ARRIVED}{rv.index}"), f"{os.getpid()}\n")
        if rv.index == 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(port_path)  # a stale name from an earlier attempt of this job
            port = MPI.Open_port()
            _write_atomic(port_path, port)
            comm = MPI.COMM_SELF.Dup()
        else:
            port = ""
            comm = _connect(rv, deadline)
        while comm.Get_size() < rv.nodes:
            inter = comm.Accept(port, root=0)
            merged = inter.Merge(high=False)
            inter.Free()
            comm.Free()
            comm = merged
        final = comm.Split(0, rv.index)
        comm.Free()
        if rv.index == 0:
            MPI.Close_port(port)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(port_path)
    finally:
        dog.done.set()
    if final.Get_rank() != rv.index or final.Get_size() != rv.nodes:
        raise FanstoreError(f"rendezvous gave rank {final.Get_rank()} of {final.Get_size()}, "
                            f"expected {rv.index} of {rv.nodes}")
    log.info("node %d joined %d nodes in %.2f s", rv.index, rv.nodes, time.monotonic() - t0)
    return final


def _connect(rv: Rendezvous, deadline: float) -> Any:
    """Connect to node 0's port, re-reading the name while it is stale (node 0 restarting)."""
    from mpi4py import MPI

    failed = ""
    while True:
        try:
            port = _read_port(rv, deadline)
        except TimeoutError:
            threading.Event().wait()  # the watchdog reports and ends the process
        if port == failed:
            if time.monotonic() > deadline:
                threading.Event().wait()
            time.sleep(0.2)
            continue
        try:
            inter = MPI.COMM_SELF.Connect(port, root=0)
        except MPI.Exception as e:
            log.warning("connect to %s failed (%s); waiting for a new port name", port, e)
            failed = port
            continue
        merged = inter.Merge(high=True)
        inter.Free()
        return merged


def node_index(nodelist: list[str], name: str) -> int:
    """This node's position in the job's node list (`scontrol show hostnames` order)."""
    try:
        return nodelist.index(name)
    except ValueError:
        raise FanstoreError(f"node {name!r} is not in the job's node list {nodelist}") from None
