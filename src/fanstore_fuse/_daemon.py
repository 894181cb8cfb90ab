"""The mount daemon of one node: stage in, build the node, mount with pyfuse3, serve on trio."""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import functools
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypedDict

import pyfuse3
import trio

from ._blobstore import BlobStore
from ._compose import Parts, compose, open_transport
from ._errors import FanstoreError
from ._fsio import atomic_write
from ._fuse_ops import PATCHED, Operations
from ._fuseaccess import fuse_access_problem, mount_failure
from ._mountctl import (
    LocalDirBusy,
    MountState,
    check_mountpoint,
    default_local_dir,
    mount_key,
    prepare_local_dir,
    remove_local_dir,
    state_dir,
)
from ._readahead import hold_readahead, set_readahead
from ._settings import Settings
from ._stageout_all import StopRequest, serve_requests
from ._startup import Exchange, MappedPages, PeerFailed, Phases, Staged, stage
from ._transport import MpiTransport, Transport, mpi_env_defaults, unlink_shared_segments
from ._view import MountView
from .writes import WriteStore

log = logging.getLogger("fanstore_fuse.daemon")


@dataclass
class MountConfig:
    dest: str
    mountpoint: str  # may contain {rank}
    local_dir: str | None = None  # may contain {rank}
    fuse_options: list[str] = field(default_factory=list)
    ready_fd: int | None = None
    ready_file: str | None = None
    debug: bool = False
    max_tasks: int = 128  # concurrent FUSE requests (each may wait on a remote fetch)
    mpi: bool = False
    replicas: int = 1
    warm_metadata: bool = True
    peer_timeout: float = 10.0
    readahead_kb: int = 1024
    writable: bool = True
    write_quota: int | None = None
    progress_file: str | None = None  # rank 0 reports stage-in progress here for the launcher
    join: str | None = None  # rendezvous dir: daemons started one per node join one group
    node_index: int = 0  # with join: this node's index in the job's node list
    nodes: int = 1  # with join: how many nodes
    join_timeout: float = 120.0
    stage_out: str | None = None  # recorded for `umount` (and the SLURM epilog)
    cache_size: str | None = None  # disk cache of remote blobs; None: FANSTORE_CACHE_SIZE or 50%
    world: int = 0  # with mpi: how many ranks the launcher started (0: as srun/mpiexec tell)


def fuse_options(cfg: MountConfig) -> set[str]:
    opts = set(pyfuse3.default_options)
    opts |= {f"fsname=fanstore:{os.path.abspath(cfg.dest)}", "subtype=fanstore", "default_permissions"}
    for o in cfg.fuse_options:
        for part in o.split(","):
            if part.strip().startswith("max_read"):
                raise FanstoreError("-o max_read is not supported (it breaks pyfuse3 sessions)")
            if part.strip():
                opts.add(part.strip())
    opts.discard("nonempty")
    if not cfg.writable:  # the kernel refuses every write itself (files open without OPEN)
        opts.add("ro")
    return opts


def for_rank(template: str, rank: int) -> str:
    return os.path.abspath(template.replace("{rank}", str(rank)))


def notify(fd: int | None, message: str) -> None:
    """Tell the launching `mount` process how the start went (one line on a pipe)."""
    if fd is None:
        return
    with contextlib.suppress(OSError):
        os.write(fd, (message.replace("\n", " ") + "\n").encode())
        os.close(fd)


def write_ready_file(path: str | None, message: str) -> None:
    if path:
        atomic_write(path, message + "\n")


class _RankInfo(TypedDict):
    """What each rank reports to the others after setting up (allgather)."""

    rank: int
    error: str
    pid: int
    mountpoint: str
    local: str
    host: str
    staged: int
    stage_us: int


@dataclass
class _Mounted:
    """What one rank set up, so that it can be torn down in reverse."""

    mountpoint: str
    local: str | None = None
    store: BlobStore | None = None
    mounted: bool = False
    created_mountpoint: bool = False
    held: dict[str, int] = field(default_factory=dict)
    writes: WriteStore | None = None
    parts: Parts | None = None
    clock: Phases = field(default_factory=lambda: Phases(0))

    def teardown(self) -> None:
        if self.writes is not None:
            with contextlib.suppress(Exception):
                self.writes.close_store()
        if self.mounted:
            with contextlib.suppress(Exception):
                pyfuse3.close(unmount=True)
            self.mounted = False
        if self.parts is not None:
            self.parts.close()
        if self.store is not None:
            self.store.close()
        if self.local:
            remove_local_dir(self.local, keep_writes=True)
        if self.created_mountpoint:
            with contextlib.suppress(OSError):
                os.rmdir(self.mountpoint)


def _setup(cfg: MountConfig, rank: int, nranks: int, m: _Mounted, exchange: Exchange) -> Staged:
    """Check the mountpoint, stage in this rank's share (`_startup.stage`), open the write store."""
    mp = m.mountpoint
    if "{rank}" in cfg.mountpoint and not os.path.exists(mp):
        os.makedirs(mp, exist_ok=True)
        m.created_mountpoint = True
    check_mountpoint(mp, allow_nonempty="nonempty" in ",".join(cfg.fuse_options))
    problem = fuse_access_problem(fuse_options(cfg))
    if problem:
        raise FanstoreError(problem)
    state_dir()  # a state dir we may not use is a one-line error now, not after mounting
    local_t = cfg.local_dir or (default_local_dir(cfg.mountpoint) + ("/{rank}" if nranks > 1 else ""))
    try:
        m.local = prepare_local_dir(for_rank(local_t, rank))
    except LocalDirBusy as e:
        if nranks > 1 and "{rank}" not in local_t:  # this rank's neighbour on the host has it
            raise FanstoreError(f"--local {local_t} is shared by the ranks on one host: put "
                                f"{{rank}} in it (e.g. --local {local_t}/{{rank}})") from e
        raise
    staged = stage(cfg.dest, m.local, rank, nranks, cfg.replicas, exchange, m.clock,
                   cfg.progress_file)
    m.store, m.held = staged.store, staged.held
    if cfg.writable:
        m.writes = WriteStore(m.local, rank, cfg.write_quota)
    m.clock("write store")
    return staged


NO_PATCH = ("pyfuse3 without the fanstore patch (install it with scripts/install-pyfuse3.sh): "
            "files are opened through the daemon, every open and close costs a request, "
            "reads of small files are slower")


def _mount(cfg: MountConfig, m: _Mounted, view: MountView) -> None:
    opts = fuse_options(cfg)
    if cfg.debug:
        opts.add("debug")
    # before any OPEN comes: with the patched pyfuse3 the first OPEN is answered ENOSYS and the
    # kernel opens files without asking from then on (`MountView`, "no_open")
    view.no_open = PATCHED
    if not PATCHED:
        log.warning("%s", NO_PATCH)
    try:
        pyfuse3.init(Operations(view), m.mountpoint, opts)
    except RuntimeError as e:
        raise FanstoreError(mount_failure(str(e), opts)) from None
    m.mounted = True
    log.info("files open without OPEN: %s", view.no_open)
    set_readahead(m.mountpoint, cfg.readahead_kb)


async def _serve(parts: Parts, max_tasks: int,
                 side: list[Callable[[], Awaitable[None]]]) -> None:
    async with trio.open_nursery() as nursery:
        parts.node.attach(nursery)

        async def on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
                async for sig in sigs:
                    log.info("signal %d: unmounting", sig)
                    pyfuse3.terminate()
                    return

        nursery.start_soon(on_signal)
        nursery.start_soon(parts.transport.run)
        if parts.warm is not None:
            nursery.start_soon(parts.warm)
        for task in side:
            nursery.start_soon(task)
        await pyfuse3.main(min_tasks=1, max_tasks=max_tasks)
        nursery.cancel_scope.cancel()


class OneRank:
    """The communicator of a mount without MPI: rank 0 of 1."""

    def Get_rank(self) -> int:  # noqa: N802 (mpi4py's names)
        return 0

    def Get_size(self) -> int:  # noqa: N802
        return 1

    def allgather(self, obj: object) -> list[object]:
        return [obj]


def communicator(cfg: MountConfig) -> tuple[Any, int, int]:
    """(comm, rank, size): MPI.COMM_WORLD of mpiexec/srun, the group joined by daemons started
    one per node (`cfg.join`, see `_rendezvous`), or `OneRank` without MPI.

    MPI is initialised here, after a look at what started this rank (`_mpilib.start_problem`):
    a library without its process manager would abort in `MPI_Init` or come up alone."""
    if not cfg.mpi:
        return OneRank(), 0, 1
    from mpi4py import rc

    from . import _mpilib

    mpi_env_defaults()  # before MPI_Init
    rc.initialize = False
    rc.finalize = True  # at exit, as when mpi4py initialises MPI itself
    rc.thread_level = "multiple"
    from mpi4py import MPI

    lib = _mpilib.Library(MPI.Get_library_version())
    if not cfg.join and (why := _mpilib.start_problem(lib, os.environ, cfg.world)):
        raise FanstoreError(why)
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    if cfg.join:
        from ._rendezvous import Rendezvous, join

        rv = Rendezvous(cfg.join, cfg.node_index, cfg.nodes, cfg.join_timeout)
        comm = join(rv, lambda msg: _report_failure(cfg, f"error: {msg}"))
    else:
        comm = MPI.COMM_WORLD
        # N one-rank file systems would each serve everything as rank 0, none shared
        if why := _mpilib.world_problem(lib, os.environ, comm.Get_size(), cfg.world):
            raise FanstoreError(why)
        comm.Barrier()  # every rank of this host has attached MPICH's shared memory
        unlink_shared_segments()
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    return comm, comm.Get_rank(), comm.Get_size()


def _report_failure(cfg: MountConfig, msg: str) -> None:
    """Every rank reports; the launcher reads the file where it waits (another node's state
    dir may not exist, so a rank that cannot write there says nothing)."""
    with contextlib.suppress(OSError):
        write_ready_file(cfg.ready_file, msg)
    notify(cfg.ready_fd, msg)


def serve(cfg: MountConfig) -> int:
    """Run one rank's daemon in this process until unmounted or signalled."""
    try:
        comm, rank, nranks = communicator(cfg)
    except FanstoreError as e:
        _report_failure(cfg, f"error: {e}")
        return 1
    m = _Mounted(for_rank(cfg.mountpoint, rank), clock=Phases(rank))
    error = ""
    exchange = Exchange(comm, nranks)
    pages: MappedPages | None = None
    stop = StopRequest()
    try:
        settings = Settings.from_env()
        if cfg.cache_size is not None:
            settings = dataclasses.replace(settings, cache_size=cfg.cache_size)
        ready = _setup(cfg, rank, nranks, m, exchange)
        pages = MappedPages(ready.manifest)

        def connect(table: Any) -> Transport:
            stop.register(table)  # `umount` on another node ends this one too
            return open_transport(comm, table)

        m.parts = compose(ready.manifest, ready.store, cfg.dest, ready.placement, rank, connect,
                          m.writes, settings, m.held, cfg.peer_timeout, cfg.warm_metadata,
                          cache_dir=m.local)
        m.clock("compose")
        _mount(cfg, m, m.parts.view)
        m.clock("fuse init")
        if isinstance(m.parts.transport, MpiTransport) and hasattr(pyfuse3, "get_session_fd"):
            m.parts.transport.watch_session(pyfuse3.get_session_fd())  # the public-API patch's
    except PeerFailed:
        pass  # the rank that failed says why in the allgather below
    except FanstoreError as e:
        error = str(e)
    except Exception as e:
        log.exception("mount failed")
        error = f"{type(e).__name__}: {e}"
    exchange.fail()
    if error:
        log.error("rank %d: %s", rank, error)
    # Every rank reports; rank 0 decides for all (a failure anywhere unmounts everywhere).
    me: _RankInfo = {"rank": rank, "error": error, "pid": os.getpid(), "mountpoint": m.mountpoint,
                      "local": m.local or "", "host": socket.gethostname(),
                      "staged": m.held.get("staged_bytes", 0), "stage_us": m.held.get("stage_in_us", 0)}
    infos: list[_RankInfo] = comm.allgather(me)
    m.clock("allgather")
    failed: dict[str, list[str]] = {}  # one message, the ranks that gave it
    for i in infos:
        if i["error"]:
            failed.setdefault(i["error"], []).append(str(i["rank"]))
    errors = [f"rank{'s' * (len(r) > 1)} {', '.join(r)}: {e}" for e, r in failed.items()]
    if errors:
        m.teardown()
        msg = "error: " + "; ".join(errors)
        if rank == 0 or cfg.join:
            write_ready_file(cfg.ready_file, msg)
        notify(cfg.ready_fd, msg if nranks > 1 else f"error: {error}")
        return 1
    # Joined daemons were started one per node: each node's state holds only its own daemon.
    here = [me] if cfg.join else [i for i in infos if i["host"] == me["host"]]
    group = MountState(
        key=mount_key(cfg.mountpoint), template=os.path.abspath(cfg.mountpoint),
        dest=os.path.abspath(cfg.dest), mountpoints=[i["mountpoint"] for i in here],
        local_dirs=[i["local"] for i in here], pids=[i["pid"] for i in here], ranks=nranks,
        stage_out=os.path.abspath(cfg.stage_out) if cfg.stage_out else "",
        hosts=[i["host"] for i in infos],
    )
    own = MountState(
        key=mount_key(m.mountpoint), template=os.path.abspath(cfg.mountpoint),
        dest=group.dest, mountpoints=[m.mountpoint], local_dirs=[m.local or ""],
        pids=[os.getpid()], ranks=nranks,
    )
    if own.key != group.key:
        own.save()
    if rank == 0 or here[0]["rank"] == rank:
        group.save()
    assert pages is not None  # set by the setup, which succeeded on every rank
    pages.ready()  # what start-up touched of the manifest: back to the page cache
    summary = ""
    if rank == 0:
        staged = sum(i["staged"] for i in infos)
        secs = max(i["stage_us"] for i in infos) / 1e6
        summary = (f"stage-in: {staged} bytes on {nranks} rank(s) in {secs:.2f} s "
                   f"({staged / max(secs, 1e-9) / 1e6:.0f} MB/s aggregate)")
        log.info("%s", summary)
    if rank == 0 or cfg.join:
        write_ready_file(cfg.ready_file, "ready\n" + summary)
    notify(cfg.ready_fd, "ready")
    m.clock("ready")
    m.clock.report()
    code = 0
    assert m.parts is not None  # set by the setup, which succeeded on every rank
    side: list[Callable[[], Awaitable[None]]] = [pages.run]
    if m.parts.view.no_open:
        side.append(functools.partial(_prime_no_open, m.mountpoint, m.parts.view))
        if cfg.writable:
            side.append(m.parts.view.run_closer)  # no RELEASE: written files commit when idle
    if nranks > 1:
        mine = {i["rank"] for i in here}
        others = [r for r in range(nranks) if r not in mine]
        side.append(_stageout_requests(group.key, others, [i["host"] for i in infos],
                                       m.parts.transport, cfg.writable))
        side.append(functools.partial(stop.wait, pyfuse3.terminate))
    try:
        side.append(functools.partial(hold_readahead, m.mountpoint, cfg.readahead_kb))
        trio.run(_serve, m.parts, cfg.max_tasks, side)
    except BaseException:
        log.exception("daemon stopped on an error")
        code = 1
    finally:
        # A SIGTERM now (srun's, or a second `umount`) would end the teardown half-way: the
        # unmount and the removal of the local copy finish first.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        m.teardown()
        own.remove()
        if rank == 0 or here[0]["rank"] == rank:  # the rank that saved it on this host
            group.remove()
        if cfg.join and cfg.node_index == 0:  # Open MPI's ompi-server of this group, if any
            from ._mpilib import stop_ompi_server

            stop_ompi_server(cfg.join)
        with contextlib.suppress(OSError):  # the state dir too, once nothing is left in it
            os.rmdir(state_dir())
        # Done: a rank left waiting in MPI_Finalize for the others may be ended by SIGTERM.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        logging.shutdown()
    return code


async def _prime_no_open(mountpoint: str, view: MountView) -> None:
    """A side task: open and close one dataset file through the mount as soon as it serves,
    so that the kernel takes `no_open` (that OPEN answered ENOSYS) and `no_flush` (that close's
    FLUSH) before a reader does: no reader's close(2) ever needs the daemon then (ENOTCONN once
    it is gone). Nothing happens without a readable dataset file.

    The open is made by a child process, never by a thread of the daemon: a daemon SIGKILLed
    while one of its own threads waits on its mount never exits (that thread waits, unkillable,
    for an answer only the dead daemon could give, and keeps /dev/fuse open, so the kernel never
    aborts the connection): a zombie holding a hung mount."""
    ns = view.node.ns
    first = next((i for i in range(len(ns)) if ns.is_regular(i)), None)
    if first is None:
        return
    path = os.path.join(mountpoint, os.fsdecode(ns.path(first)))
    code = "import os, sys; os.close(os.open(sys.argv[1], os.O_RDONLY | os.O_NONBLOCK))"
    with trio.move_on_after(30):
        await trio.run_process([sys.executable, "-I", "-S", "-c", code, path], check=False,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)


def _stageout_requests(key: str, others: list[int], hosts: list[str], transport: Transport,
                       writable: bool):
    """A side task of a multi-rank daemon: answering `umount [--stage-out]` run on this node
    for every node (see `_stageout_all`)."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # until trio listens for it

    async def side() -> None:
        await serve_requests(key, others, hosts, transport, writable)

    return side


def setup_logging(debug: bool = False) -> None:
    faulthandler.enable()  # a crash in a library (libfuse, MPI) logs every thread's Python stack
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.INFO,
        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
