"""The `fanstore-fuse` command line: thin wrappers over the library modules."""

from __future__ import annotations

import json
import os
import sys
import time

import typer

from ._console import err, progress, warn_widened, warn_widened_meanwhile
from ._errors import FanstoreError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False)


@app.callback()
def _setup(verbose: bool = typer.Option(False, "--verbose", "-v")) -> None:
    """fanstore-fuse: a job-scoped distributed file system for deep-learning datasets."""
    import logging

    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="fanstore-fuse: %(levelname)s %(message)s",
        stream=sys.stderr,
    )


def _fail(msg: str, code: int = 1) -> None:
    err.print(f"[bold red]fanstore-fuse:[/] {msg}", highlight=False)
    raise typer.Exit(code)


@app.command()
def prep(
    src: str = typer.Argument(..., help="source directory tree"),
    dest: str = typer.Argument(..., help="output directory (on the shared file system)"),
    partitions: int = typer.Option(4, "--partitions", "-p", help="number of partitions"),
    codec: str = typer.Option("zstd", "--codec", help="zstd or none"),
    level: int = typer.Option(3, "--level", help="zstd level"),
    broadcast: list[str] = typer.Option([], "--broadcast", help="glob of paths copied to every node"),
    workers: int = typer.Option(0, "--workers", "-w", help="threads (0: one per CPU)"),
    chunk_mib: int = typer.Option(4, "--chunk-mib", help="chunk size for large files, MiB"),
    frame_kib: int = typer.Option(
        128, "--frame-kib", help="seekable frames in chunks over 2 frames, KiB (0: off)"),
    dictionary: str = typer.Option(
        "off", "--dict", help="auto: train a zstd dictionary when most files are small"),
    mode: str | None = typer.Option(
        None, "--mode", help="octal mode of DEST's files (default: as private as SRC)"),
    group: str | None = typer.Option(None, "--group", help="group of DEST (shares it: 0640)"),
    quiet: bool = typer.Option(False, "--quiet", "-q"),
) -> None:
    """Pack SRC into partitions and a manifest in DEST."""
    from ._perms import parse_mode
    from ._prep import PrepOptions
    from ._prep import prep as do_prep

    t0 = time.perf_counter()
    try:
        opts = PrepOptions(partitions, codec, level, chunk_mib << 20, list(broadcast), workers,
                           mode=parse_mode(mode), group=group, frame_size=frame_kib << 10,
                           dictionary=dictionary)
        with progress(quiet) as prog:
            task = prog.add_task("prep", total=None)

            last = [0.0]

            def tick(files: int, nbytes: int) -> None:
                now = time.monotonic()
                if now - last[0] > 0.1:  # a few redraws a second, not one per blob
                    last[0] = now
                    prog.update(task, completed=nbytes, description=f"prep {files} files")

            res = do_prep(src, dest, opts, progress=None if prog.disable else tick)
    except (FanstoreError, OSError) as e:
        _fail(str(e))
    dt = time.perf_counter() - t0
    ratio = res.raw_bytes / res.stored_bytes if res.stored_bytes else 1.0
    if not quiet:
        err.print(
            f"prepped {res.files} files, {res.dirs} dirs, {res.symlinks} symlinks "
            f"({res.skipped} special files skipped): {res.raw_bytes} bytes -> "
            f"{res.stored_bytes} stored ({ratio:.2f}x) in {len(res.manifest.partitions)} "
            f"partitions, {dt:.2f} s",
            highlight=False,
        )


@app.command()
def verify(
    dest: str = typer.Argument(..., help="a prepped directory"),
    workers: int = typer.Option(0, "--workers", "-w"),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Check the manifest and every blob's checksum; exit 1 on any damage."""
    from ._verify import verify as do_verify

    try:
        rep = do_verify(dest, workers=workers)
    except (FanstoreError, OSError) as e:
        _fail(f"manifest: {e}")
    warn_widened(dest)
    if json_out:
        print(json.dumps({"ok": rep.ok, "entries": rep.entries, "blobs": rep.blobs,
                          "bytes": rep.bytes, "problems": rep.problems}))
    else:
        for p in rep.problems:
            err.print(f"[red]damaged:[/] {p}", highlight=False)
        state = "OK" if rep.ok else f"{len(rep.problems)} problem(s)"
        print(f"{dest}: {rep.entries} entries, {rep.blobs} blobs, {rep.bytes} bytes: {state}")
    if not rep.ok:
        raise typer.Exit(1)


@app.command()
def mount(
    ctx: typer.Context,
    dest: str = typer.Argument(..., help="a prepped directory"),
    mountpoint: str = typer.Argument(..., help="where to mount; may contain {rank}"),
    local: str | None = typer.Option(None, "--local", help="node-local dir; may contain {rank}"),
    foreground: bool = typer.Option(False, "--foreground", "-f"),
    option: list[str] = typer.Option([], "-o", help="FUSE mount option (repeatable)"),
    debug: bool = typer.Option(False, "--debug"),
    ready_fd: int | None = typer.Option(None, "--ready-fd", hidden=True),
    timeout: float = typer.Option(600.0, "--timeout", help="seconds to wait for readiness"),
    ranks: int | None = typer.Option(
        None, "--ranks", "-n", help="local MPI ranks standing in for nodes (mpiexec)"
    ),
    replicas: int = typer.Option(1, "--replicas", "-r", help="copies of each blob on distinct ranks"),
    warm_metadata: bool = typer.Option(
        True, "--warm-metadata/--no-warm-metadata", help="pull all metadata from owners at mount"
    ),
    peer_timeout: float = typer.Option(10.0, "--peer-timeout", help="seconds before trying another copy"),
    write_quota: str | None = typer.Option(
        None, "--write-quota", help="bytes files written into the mount may take per node (10G)"
    ),
    read_only: bool = typer.Option(False, "--read-only", help="refuse all writes (EROFS)"),
    cache_size: str | None = typer.Option(
        None, "--cache-size", help="disk cache of blobs read from other nodes: 10G, 500M, a share "
        "of the local dir's free space (50%, the default; $FANSTORE_CACHE_SIZE), 0 = off",
    ),
    stage_out: str | None = typer.Option(
        None, "--stage-out", help="where `umount` (and the SLURM epilog) saves written files"
    ),
    join: str | None = typer.Option(
        None, "--join", help="shared dir where daemons started one per node meet (prolog mode)"
    ),
    node_index: int = typer.Option(0, "--node-index", help="with --join: this node's index"),
    nodes: int = typer.Option(1, "--nodes", help="with --join: number of nodes"),
    join_timeout: float = typer.Option(120.0, "--join-timeout", help="seconds to wait for all nodes"),
    mpi: bool = typer.Option(False, "--mpi", hidden=True),
    world: int = typer.Option(0, "--world", hidden=True),
    ready_file: str | None = typer.Option(None, "--ready-file", hidden=True),
    progress_file: str | None = typer.Option(None, "--progress-file", hidden=True),
) -> None:
    """Stage DEST into node-local storage and mount it at MOUNTPOINT.

    With --ranks N (or inside a SLURM job) one daemon per rank is started with mpiexec (srun);
    MOUNTPOINT and --local may then contain {rank}.
    """
    if cache_size is not None:
        from ._settings import parse_cache_size

        try:
            parse_cache_size(cache_size)
        except FanstoreError as e:
            _fail(str(e))
    multi = not mpi and (ranks is not None or bool(join) or bool(os.environ.get("SLURM_JOB_ID")))
    if not mpi and ready_fd is None:  # once, by the command the user ran
        if multi or not foreground:  # while the daemons start (it reads 3 manifest columns)
            ctx.call_on_close(warn_widened_meanwhile(dest))
        else:
            warn_widened(dest)
    if multi or not foreground:
        # The daemon(s) run this same command in the foreground, with the same options.
        argv = ["mount", dest, mountpoint, "--foreground", *_write_args(write_quota, read_only)]
        if stage_out:
            argv += ["--stage-out", os.path.abspath(stage_out)]
        if cache_size is not None:
            argv += ["--cache-size", cache_size]
        if local:
            argv += ["--local", local]
        for o in option:
            argv += ["-o", o]
        if debug:
            argv.append("--debug")
    if multi:
        from ._launch import start_ranks

        argv += ["--replicas", str(replicas), "--peer-timeout", str(peer_timeout),
                 "--warm-metadata" if warm_metadata else "--no-warm-metadata"]
        if ranks is not None and ranks > 1 and "{rank}" not in mountpoint:
            _fail("with --ranks > 1 the MOUNTPOINT must contain {rank}")
        if ranks is not None and ranks > 1 and local and "{rank}" not in local:
            _fail(f"with --ranks > 1 the ranks share this host: put {{rank}} in --local "
                  f"(e.g. --local {local}/{{rank}})")
        if join:
            argv += ["--join", os.path.abspath(join), "--node-index", str(node_index),
                     "--nodes", str(nodes), "--join-timeout", str(join_timeout)]
            ranks = 1
        try:
            st = start_ranks(argv, mountpoint, ranks, timeout, joined=bool(join))
        except FanstoreError as e:
            _fail(str(e))
        where = f" (node {node_index} of {nodes})" if join else ""
        err.print(f"mounted {dest} on {st.ranks} rank(s){where}: {', '.join(st.mountpoints)}",
                  highlight=False)
        return
    if not foreground:
        from ._launch import start_background
        from ._mountctl import check_mountpoint

        try:
            check_mountpoint(mountpoint, allow_nonempty="nonempty" in ",".join(option))
            pid = start_background(argv, os.path.abspath(mountpoint), timeout)
        except FanstoreError as e:
            _fail(str(e))
        err.print(f"mounted {dest} at {mountpoint} (daemon pid {pid})", highlight=False)
        return
    from ._daemon import MountConfig, serve, setup_logging  # the daemon only: pyfuse3, trio, numpy

    setup_logging(debug)
    cfg = MountConfig(
        dest, mountpoint, local, list(option), ready_fd, ready_file, debug, mpi=mpi,
        replicas=replicas, warm_metadata=warm_metadata, peer_timeout=peer_timeout,
        writable=not read_only, write_quota=_parse_size(write_quota),
        progress_file=progress_file, join=join, node_index=node_index, nodes=nodes,
        join_timeout=join_timeout, stage_out=stage_out, cache_size=cache_size, world=world,
    )
    raise typer.Exit(serve(cfg))


def _parse_size(text: str | None) -> int | None:
    if text is None:
        return None
    from ._settings import parse_size

    try:
        return parse_size(text)
    except FanstoreError as e:
        _fail(str(e))
        raise


def _write_args(write_quota: str | None, read_only: bool) -> list[str]:
    out = ["--write-quota", write_quota] if write_quota else []
    return out + (["--read-only"] if read_only else [])


@app.command()
def umount(
    mountpoint: str = typer.Argument(..., help="a mountpoint (or the {rank} template)"),
    timeout: float = typer.Option(15.0, "--timeout", help="seconds before SIGKILL"),
    stage_out: str | None = typer.Option(
        None, "--stage-out", help="copy every file written into the mount to this directory"
    ),
    workers: int = typer.Option(4, "--workers", "-w", help="parallel copies for --stage-out"),
) -> None:
    """Unmount, stop the daemon(s), stage out written files, remove the node-local copies.

    A mount whose ranks run on several nodes ends on every node: every node's written files
    are staged out first (to DIR, else to the directory given at mount time, `mount
    --stage-out`); then every node's daemon unmounts and removes its local copy (a copy whose
    written files were not saved stays, for `recover`)."""
    from ._mountctl import find_state
    from ._mountctl import umount as do_umount

    try:  # the state dir itself may be refused (not ours, unreadable): one line, as below
        st = find_state(mountpoint)
        target = stage_out or (st.stage_out if st is not None else "") or None
        remote_failed = target is not None and not _stage_out_other_nodes(mountpoint, target)
        remote_failed = not _stop_other_nodes(mountpoint) or remote_failed
        res = do_umount(mountpoint, timeout, stage_out, workers)
    except FanstoreError as e:
        _fail(str(e))
    what = "cleaned stale mount" if res.stale else "unmounted"
    err.print(f"{what}: {', '.join(res.mountpoints)}", highlight=False)
    if res.stage_out is not None:
        err.print(res.stage_out.line(), highlight=False)
        for f in res.stage_out.failures:
            err.print(f"not saved: {f.path!r}: {f.reason} (kept in {f.local})", highlight=False)
    for d in res.kept:
        err.print(f"written files kept in {d}: `fanstore-fuse recover {d} --stage-out DIR`",
                  highlight=False)
    if remote_failed or (res.stage_out is not None and not res.stage_out.ok):
        raise typer.Exit(1)


def _stage_out_other_nodes(mountpoint: str, out_dir: str) -> bool:
    """Ask the ranks on other nodes to stage out their written files; False if any did not."""
    from . import _stageout_all
    from ._mountctl import find_state

    st = find_state(mountpoint)
    if st is None or not _stageout_all.needed(st):
        return True
    try:
        results = _stageout_all.request(st, out_dir)
    except FanstoreError as e:
        err.print(f"other nodes: {e}", highlight=False)
        return False
    for r in results:
        for line in _stageout_all.describe(r, st.template, out_dir):
            err.print(line, highlight=False)
    return all(r.get("ok") for r in results)


def _stop_other_nodes(mountpoint: str) -> bool:
    """Ask the ranks on other nodes to unmount and end; False if any could not be asked."""
    from . import _stageout_all
    from ._mountctl import find_state

    st = find_state(mountpoint)
    if st is None or not _stageout_all.needed(st):
        return True
    try:
        results = _stageout_all.stop_others(st)
    except FanstoreError as e:
        err.print(f"other nodes: {e}", highlight=False)
        return False
    for r in results:
        for line in _stageout_all.describe(r, st.template, ""):
            err.print(line, highlight=False)
    return all(r.get("ok") for r in results)


@app.command()
def recover(
    local_dir: str = typer.Argument(..., help="a node-local directory left by a mount"),
    stage_out: str = typer.Option(..., "--stage-out", help="where to copy the written files"),
    workers: int = typer.Option(4, "--workers", "-w"),
    salvage_unclosed: bool = typer.Option(
        False, "--salvage-unclosed", help="also copy files never closed (unverified)"
    ),
    force: bool = typer.Option(False, "--force", help="even if a live daemon seems to own it"),
) -> None:
    """Rescue the files written into a mount whose daemon died before stage-out."""
    from ._recover import recover as do_recover

    try:
        res = do_recover(local_dir, stage_out, workers, force, salvage_unclosed)
    except FanstoreError as e:
        _fail(str(e))
    err.print(res.line(), highlight=False)
    for u in res.unclosed:
        err.print(f"unclosed: {u}", highlight=False)
    for w in res.warnings:
        err.print(f"warning: {w}", highlight=False)
    for f in res.failures:
        err.print(f"not saved: {f.path!r}: {f.reason}", highlight=False)
    if not res.ok:
        raise typer.Exit(1)


@app.command()
def status(
    mountpoint: str = typer.Argument(...),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Counters from the running daemon(s) of a mount (every rank's, via any one rank)."""
    from ._mountctl import find_state, is_mounted

    if not is_mounted(mountpoint):
        try:
            st = find_state(mountpoint)
        except FanstoreError as e:
            _fail(str(e))
        if st is not None and st.mountpoints:
            mountpoint = st.mountpoints[0]
    try:
        raw = os.getxattr(mountpoint, "user.fanstore.status")
    except OSError as e:
        _fail(f"{mountpoint}: no status ({e.strerror})")
    data = json.loads(raw)
    if json_out:
        print(json.dumps(data, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    # READs and the bytes they returned; each READ's blob from the memory cache (cache hits) or
    # fetched from this node's disk (local: partitions and disk cache) or elsewhere (remote):
    # `Stats` in _node.py. Eight narrow columns: the table fits 80 columns.
    cols = [("rank", "rank"), ("host", "host"), ("reads", "reads"), ("bytes read", "read_bytes"),
            ("cache hits", "cache_hits"), ("local", "local_reads"), ("remote", "remote_reads"),
            ("errors", "errors")]
    table = Table(title=f"fanstore-fuse status: {mountpoint}")
    for title, _ in cols:
        table.add_column(title, justify="right")
    for r in data.get("ranks", []):
        flat = {**r, **r.get("stats", {}), **(r.get("writes") or {}),
                **{f"disk_cache_{k}": v for k, v in (r.get("disk_cache") or {}).items()}}
        table.add_row(*(f"{flat[k]:,}" if isinstance(flat.get(k), int) else str(flat.get(k, "-"))
                        for _, k in cols))
    Console().print(table)
    for r in data.get("ranks", []):
        if r.get("error"):
            err.print(f"rank {r.get('rank')}: {r['error']}", highlight=False)


@app.command("slurm-prolog")
def slurm_prolog(plan: str | None = typer.Option(None, "--plan", hidden=True)) -> None:
    """SLURM Prolog= (root, every node): mount what the job asked for with
    `--comment=fanstore:DEST[,...]`, as the job user; exit 0 only once the mount answers."""
    from . import _slurmjob as sj

    if plan is not None:  # the job-user side
        try:
            print(sj.user_prolog(sj.JobPlan.from_json(plan)))
        except (FanstoreError, OSError) as e:
            _fail(str(e))
        return
    job = os.environ.get("SLURM_JOB_ID", "?")
    node = os.environ.get("SLURMD_NODENAME", "?")
    try:
        p = sj.plan_from_env(dict(os.environ))
    except sj.BadRequest as e:
        sj.log(job, node, f"prolog: {e}; job cancelled")
        sj.cancel_job(job, str(e))
        err.print(f"{e}; job cancelled", highlight=False)
        return
    except FanstoreError as e:
        sj.log(job, node, f"prolog: {e}")
        _fail(f"job {job}: {e}")
    if p is None:
        return
    sj.save_record(p)
    where = f"job {p.job_id} node {p.node_index}/{p.nodes}"
    r = _as_job_user(p, "slurm-prolog", p.timeout + 120)
    out = " ".join((r.stdout + r.stderr).split()) if r else "timed out"
    if r is None or r.returncode != 0:
        if r is None:
            _as_job_user(p, "slurm-epilog", 120)
        sj.remove_record(p)
        sj.log(p.job_id, p.node, f"prolog {where}: mount failed: {out} (cleaned up)")
        _fail(f"{where}: mount of {p.dest} failed: {out} (cleaned up; nothing left mounted)")
    sj.log(p.job_id, p.node, f"prolog {where}: {out}")
    err.print(f"{where}: {out}", highlight=False)


@app.command("slurm-epilog")
def slurm_epilog(plan: str | None = typer.Option(None, "--plan", hidden=True)) -> None:
    """SLURM Epilog= (root, every node): unmount this job's mount only, staging written files
    out to the directory recorded at mount time first; exit 1 if anything could not be saved."""
    from . import _slurmjob as sj
    from ._mountctl import lazy_unmount

    if plan is not None:  # the job-user side
        try:
            ok, lines = sj.user_epilog(sj.JobPlan.from_json(plan))
        except (FanstoreError, OSError) as e:
            _fail(str(e))
        for line in lines:
            print(line)
        raise typer.Exit(0 if ok else 1)
    job = os.environ.get("SLURM_JOB_ID", "")
    p = sj.load_record(job, os.environ.get("SLURMD_NODENAME", "")) if job else None
    recorded = p is not None
    if p is None:
        p = sj.script_mode_plan(dict(os.environ))
        if p is None:
            return
    r = _as_job_user(p, "slurm-epilog", 3600)
    out = " ".join((r.stdout + r.stderr).split()) if r else "timed out"
    forced = lazy_unmount(p.mountpoint)  # a backstop: nothing of this job stays mounted
    where = f"job {p.job_id}" + (f" node {p.node_index}" if p.node_index >= 0 else "")
    sj.log(p.job_id, p.node, f"epilog {where}: {out}" + ("; forced unmount" if forced else ""))
    err.print(f"{where}: {out}", highlight=False)
    if recorded and r is not None and r.returncode == 0:
        sj.remove_record(p)
    elif recorded:
        _fail(f"{where}: {out}")


def _as_job_user(p, verb: str, timeout: float):
    import subprocess

    from . import _slurmjob as sj

    try:
        return sj.run_as_user(p, verb, timeout)
    except subprocess.TimeoutExpired:
        return None
    except FanstoreError as e:
        return subprocess.CompletedProcess([], 1, "", str(e))
