"""fanstore-fuse, driven only through its CLI contract:

  fanstore-fuse prep SRC DEST [--partitions N] [--codec zstd|none] [--level L] [--workers W]
  fanstore-fuse mount DEST MOUNTPOINT [--local DIR] [-o OPTION]     # returns once it answers
  fanstore-fuse mount DEST '/x/{rank}' --ranks N [--local '/l/{rank}']  # N local MPI ranks
  fanstore-fuse umount MOUNTPOINT
  fanstore-fuse status MOUNTPOINT --json

When the CLI (or a sub-command) is not there, the system reports itself unavailable and the
harness prints "n/a (...)" in its columns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ._anchors import System
from ._util import REPO, Mount, dir_bytes, drop_caches, register, rm_rf, run_cmd, venv_tool
from ._util import wait_mounted as _wait_mounted


def cli_command() -> tuple[list[str] | None, dict[str, str], str]:
    """(argv prefix, extra env, why-not) for the fanstore-fuse CLI."""
    exe = venv_tool("fanstore-fuse")
    if exe:
        return [exe], {}, ""
    if (REPO / "src" / "fanstore_fuse" / "cli.py").exists():
        py = venv_tool("python") or sys.executable
        env = {"PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
        code = "import sys; from fanstore_fuse.cli import app; sys.argv[0] = 'fanstore-fuse'; app()"
        return [py, "-c", code], env, ""
    return None, {}, "fanstore-fuse CLI not available (no entry point, no src/fanstore_fuse/cli.py)"


def _help(cmd: list[str], env: dict[str, str], *sub: str) -> tuple[bool, str]:
    try:
        cp = subprocess.run(
            [*cmd, *sub, "--help"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            timeout=60, env={**os.environ, **env},
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        return False, str(e)
    return cp.returncode == 0, cp.stdout


class FanStore(System):
    """fanstore-fuse with ``ranks`` local ranks (1: single node, no MPI)."""

    remote_capable = True

    def __init__(self, ds, work, level, ranks: int = 1, partitions: int = 8, workers: int = 2,
                 dest: Path | None = None, **kw):  # fmt: skip
        self.ranks = ranks
        self.partitions = partitions
        self.workers = workers
        self.dest = dest or (work / "fanstore-dest")
        super().__init__(ds, work, level, **kw)
        self.key = "fanstore1" if ranks == 1 else f"fanstore{ranks}"
        self.label = "fanstore-fuse 1 rank" if ranks == 1 else f"fanstore-fuse {ranks} ranks"
        self.mountpoints: list[str] = []
        self.read_only: list[str] = []

    def check(self) -> tuple[bool, str]:
        self.cmd, self.env, why = cli_command()
        if self.cmd is None:
            return False, why
        ok, out = _help(self.cmd, self.env)
        if not ok:
            return False, f"fanstore-fuse --help failed: {out.strip()[-300:]}"
        for sub in ("prep", "mount", "umount"):
            if sub not in out:
                return False, f"fanstore-fuse has no '{sub}' command yet"
        ok, out = _help(self.cmd, self.env, "prep")
        self.prep_quiet = ["--quiet"] if ok and "--quiet" in out else []
        # The anchors are read-only file systems: compare like with like. A --read-only mount
        # answers FUSE flush with ENOSYS (no round trip per close); a writable one does not.
        ok, out = _help(self.cmd, self.env, "mount")
        self.read_only = ["--read-only"] if ok and "--read-only" in out else []
        if self.ranks > 1:
            ok, out = _help(self.cmd, self.env, "mount")
            if not ok or "--ranks" not in out:
                return False, "fanstore-fuse mount has no --ranks yet"
        return True, ""

    def _run(self, *args: str, timeout: float = 1800, check: bool = True):
        return run_cmd([*self.cmd, *args], timeout=timeout, check=check,
                       env={**os.environ, **self.env})  # fmt: skip

    def prep(self) -> dict:
        rm_rf(self.dest)
        drop_caches()
        args = [
            "prep", str(self.ds.src), str(self.dest), "--partitions", str(self.partitions),
            "--codec", "zstd", "--level", str(self.level), "--workers", str(self.workers),
            *self.prep_quiet,
        ]  # fmt: skip
        dt, _ = self._run(*args)
        return {"prep_s": dt, "image_bytes": dir_bytes(self.dest),
                "prep_cmd": "fanstore-fuse " + " ".join(args)}  # fmt: skip

    def mount(self) -> dict:
        if self.ranks == 1:
            mps = [str(self.work / "mnt-fanstore1")]
            locs = [str(self.work / "local-fanstore1")]
            mp_arg, loc_arg, extra = mps[0], locs[0], list(self.read_only)
        else:
            tag = f"fanstore{self.ranks}"
            mp_arg = str(self.work / f"mnt-{tag}" / "{rank}")
            loc_arg = str(self.work / f"local-{tag}" / "{rank}")
            mps = [mp_arg.format(rank=r) for r in range(self.ranks)]
            locs = [loc_arg.format(rank=r) for r in range(self.ranks)]
            # no disk cache of remote blobs: repeated cold reads must stay remote reads (the
            # second epoch from the cache is bench/epoch2.py's)
            extra = ["--ranks", str(self.ranks), "--cache-size", "0", *self.read_only]
        for d in mps:
            Path(d).mkdir(parents=True, exist_ok=True)
        for d in locs:
            rm_rf(d)
        self.mountpoints = mps
        self.locals = locs
        marker = str(Path(mps[0]).parent if self.ranks > 1 else mps[0])
        # one Mount record per rank; rank 0's also kills every daemon whose cmdline names our
        # (unique, per-run) mount path, and removes the local copies
        # (`umount` of the template, or of the single mountpoint, stops every rank)
        for i, mp in enumerate(mps):
            register(Mount(
                mp, umount_cmd=[*self.cmd, "umount", mp_arg] if i == 0 else None,
                pid_marker=marker if i == 0 else None,
            ))  # fmt: skip
        self._mounts = [m for m in _registered(mps)]
        self._mount = None
        drop_caches()
        t0 = time.perf_counter()
        args = ["mount", str(self.dest), mp_arg, "--local", loc_arg, *extra]
        self._run(*args, timeout=self.mount_timeout)
        for mp in mps:
            _wait_mounted(mp, self.mount_timeout)
        dt = time.perf_counter() - t0
        self.root = mps[0]
        c = self.counters() or {}
        staged = c.get("staged_bytes") or sum(dir_bytes(d) for d in locs if os.path.isdir(d))
        return {"mount_s": dt, "staged_bytes": staged, "mount_cmd": "fanstore-fuse " + " ".join(args)}

    def umount(self) -> list[str]:
        from ._util import teardown

        problems: list[str] = []
        for m in getattr(self, "_mounts", []):
            problems += teardown(m)
        self._mounts = []
        for d in getattr(self, "locals", []):
            if os.path.isdir(d):
                problems.append(f"local copy {d} left behind by umount (removed)")
                rm_rf(d)
        return problems

    # -- remote reads -----------------------------------------------------------------------

    def status(self, mp: str) -> dict | None:
        try:
            _, cp = self._run("status", mp, "--json", timeout=60, check=False)
        except Exception:  # noqa: BLE001
            return None
        if cp.returncode != 0:
            return None
        try:
            return json.loads(cp.stdout)
        except ValueError:
            return None

    def status_all(self) -> list[dict] | None:
        """Per-rank status dicts: ``{"ranks": [...]}`` (multi-rank) or one rank's dict."""
        per_rank: list[dict] = []
        for mp in self.mountpoints:
            try:
                st = json.loads(os.getxattr(mp, "user.fanstore.status"))
            except (OSError, ValueError):
                return None
            if isinstance(st, dict) and isinstance(st.get("ranks"), list):
                return [r for r in st["ranks"] if isinstance(r, dict)]  # every rank, from any mount
            if isinstance(st, dict):
                per_rank.append(st)
        return per_rank

    def counters(self) -> dict[str, int] | None:
        """Numeric counters summed over ranks (local/remote reads and bytes, served blobs, ...)."""
        ranks = self.status_all()
        if ranks is None:
            return None
        total: dict[str, int] = {}
        for st in ranks:
            flat = dict(st.get("stats", {}))
            flat.update({k: v for k, v in st.items() if k != "stats"})
            for k, v in flat.items():
                if isinstance(v, int) and not isinstance(v, bool) and k != "rank":
                    total[k] = total.get(k, 0) + v
        return total

    def remote_files(self) -> list[tuple[str, int]] | None:
        """Large files that rank 0 does not hold locally (read through rank 0's mount)."""
        if self.ranks < 2 or not self.mountpoints:
            return None
        st = self.status(self.mountpoints[0]) or {}
        owners = _find_owner_map(st)
        me = st.get("rank", 0) if isinstance(st.get("rank", 0), int) else 0
        if owners is None:
            owners = _owner_xattrs(self.mountpoints[0], [rel for rel, _ in self.ds.large])
        if owners is None:
            return None
        out = []
        for rel, size in self.ds.large:
            o = owners.get(rel, owners.get("/" + rel))
            if o is not None and o != me:
                out.append((rel, size))
        return out


def _registered(mps: list[str]) -> list[Mount]:
    from ._util import _MOUNTS

    return [m for m in _MOUNTS if m.mountpoint in mps and not m.done]


def _find_owner_map(st: dict) -> dict[str, int] | None:
    """Look for a {path: owner rank} map in a status JSON (the key name is not fixed yet)."""
    for key in ("owners", "file_owners", "owner_of", "placement"):
        v = st.get(key)
        if isinstance(v, dict):
            return {str(k): int(x) for k, x in v.items() if isinstance(x, int)}
    return None


OWNER_XATTRS = ("user.fanstore.owner", "user.fanstore.rank", "user.fanstore.owners")


def _owner_xattrs(root: str, rels: list[str]) -> dict[str, int] | None:
    """Owner rank of each file from a per-file xattr, when the daemon offers one."""
    out: dict[str, int] = {}
    for rel in rels:
        for name in OWNER_XATTRS:
            try:
                raw = os.getxattr(os.path.join(root, rel), name)
            except OSError:
                continue
            try:
                v = json.loads(raw)
            except ValueError:
                continue
            if isinstance(v, list) and v:
                v = v[0]
            if isinstance(v, int):
                out[rel] = v
                break
    return out or None
