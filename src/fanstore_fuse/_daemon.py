"""The mount daemon of one node: stage in, build the node, mount with pyfuse3, serve on trio."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from dataclasses import dataclass, field

import pyfuse3
import trio

from ._blobstore import BlobStore
from ._errors import FanstoreError
from ._format import MANIFEST_NAME, read_manifest
from ._fuse_ops import Operations
from ._mountctl import (
    MountState,
    check_mountpoint,
    default_local_dir,
    mount_key,
    prepare_local_dir,
    remove_local_dir,
)
from ._namespace import Namespace
from ._node import LocalBlobSource, Node, Stats

log = logging.getLogger("fanstore_fuse.daemon")


@dataclass
class MountConfig:
    dest: str
    mountpoint: str
    local_dir: str | None = None
    fuse_options: list[str] = field(default_factory=list)
    ready_fd: int | None = None
    debug: bool = False
    max_tasks: int = 64


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
    return opts


def notify(fd: int | None, message: str) -> None:
    """Tell the launching `mount` process how the start went (one line on a pipe)."""
    if fd is None:
        return
    with contextlib.suppress(OSError):
        os.write(fd, (message.replace("\n", " ") + "\n").encode())
        os.close(fd)


async def _serve(node: Node, max_tasks: int) -> None:
    async with trio.open_nursery() as nursery:
        node.attach(nursery)

        async def on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
                async for sig in sigs:
                    log.info("signal %d: unmounting", sig)
                    pyfuse3.terminate()
                    return

        nursery.start_soon(on_signal)
        await pyfuse3.main(min_tasks=1, max_tasks=max_tasks)
        nursery.cancel_scope.cancel()


def serve(cfg: MountConfig) -> int:
    """Run a single-node mount in this process until unmounted or signalled."""
    mp = os.path.abspath(cfg.mountpoint)
    local = None
    mounted = False
    state = None
    store = None
    try:
        check_mountpoint(mp, allow_nonempty="nonempty" in ",".join(cfg.fuse_options))
        manifest = read_manifest(os.path.join(cfg.dest, MANIFEST_NAME))
        local = prepare_local_dir(cfg.local_dir or default_local_dir(mp))
        from ._stage import stage_in

        res = stage_in(cfg.dest, local, manifest)
        log.info("staged %d partitions, %d bytes into %s", res.partitions, res.bytes, local)
        ns = Namespace(manifest)
        stats = Stats()
        store = BlobStore(manifest, local)
        node = Node(ns, LocalBlobSource(store, stats), stats)
        ops = Operations(node)
        opts = fuse_options(cfg)
        if cfg.debug:
            opts.add("debug")
        pyfuse3.init(ops, mp, opts)
        mounted = True
        state = MountState(
            key=mount_key(mp), template=mp, dest=os.path.abspath(cfg.dest), mountpoints=[mp],
            local_dirs=[local], pids=[os.getpid()],
        )
        state.save()
    except FanstoreError as e:
        log.error("%s", e)
        notify(cfg.ready_fd, f"error: {e}")
        if mounted:
            pyfuse3.close(unmount=True)
        if local:
            remove_local_dir(local)
        return 1
    except Exception as e:
        log.exception("mount failed")
        notify(cfg.ready_fd, f"error: {type(e).__name__}: {e}")
        if mounted:
            pyfuse3.close(unmount=True)
        if local:
            remove_local_dir(local)
        return 1
    notify(cfg.ready_fd, "ready")
    code = 0
    try:
        trio.run(_serve, node, cfg.max_tasks)
    except BaseException:
        log.exception("daemon stopped on an error")
        code = 1
    finally:
        with contextlib.suppress(Exception):
            pyfuse3.close(unmount=True)
        store.close()
        remove_local_dir(local)
        state.remove()
        logging.shutdown()
    return code


def setup_logging(debug: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.INFO,
        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
