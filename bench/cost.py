"""CPU cost and latency of a file read: ``python -m bench.cost [--files N] [--json PATH]``.

Figures a loaded 2-core machine does not distort (issue 11): the daemons' CPU time (every
thread's schedstat: exact, where /proc/PID/stat's ticks are 10 ms; every process of the mount)
per file read, for local reads (1 rank) and remote reads (2 ranks, rank 0 reading only files
whose blobs rank 1 holds, client and server daemons together); single-reader latency p50/p99 per
file; the default (writable) mount beside ``--read-only`` on warm reads; squashfuse and
squashfuse_ll as anchors. The remote / local bars are the medians of per-round ratios: each
remote pass over the local pass of the same files in the same round (`--cold-rounds`, 5),
as bench.epoch2's bar. The CPU costs then feed the scale model (bench/scale_model.py) for
1..512 nodes at 550 and 20,000 files/s/node.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import _projection, _ringsim, _vmnoise
from ._fanstore import cli_command
from ._profile import Profiler, daemon_pids, summarize
from ._util import (
    REPO,
    Mount,
    drop_caches,
    log,
    pids_with_arg,
    read_copy,
    register,
    rm_rf,
    run_cmd,
    teardown,
    teardown_all,
    wait_mounted,
)

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """user+sys seconds of these processes (fields 14 and 15 of /proc/PID/stat): whole clock
    ticks (10 ms), so a difference over a pass is coarse; `cpu_snapshot` is exact."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / TICK


def _thread_ns(pid: int) -> dict[int, int]:
    """tid -> nanoseconds on a CPU (the first field of /proc/PID/task/TID/schedstat)."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return out


CpuSnapshot = dict[int, tuple[float, dict[int, int]]]


def cpu_snapshot(pids: list[int]) -> CpuSnapshot:
    """Each process's CPU time now: ticks (cpu_seconds) and every thread's exact schedstat."""
    return {pid: (cpu_seconds([pid]), _thread_ns(pid)) for pid in pids}


def cpu_since_by_pid(before: CpuSnapshot) -> dict[int, float]:
    """CPU seconds each process used since `before`: the sum of its threads' schedstat
    differences (threads started since count from 0), exact where ticks are 10 ms; a process
    one of whose threads ended meanwhile (its time is then only in the process's ticks) falls
    back to the ticks."""
    out = {}
    for pid, (ticks0, ns0) in before.items():
        ns1 = _thread_ns(pid)
        if ns1 and all(tid in ns1 for tid in ns0):
            out[pid] = sum(ns - ns0.get(tid, 0) for tid, ns in ns1.items()) / 1e9
        else:
            out[pid] = max(0.0, cpu_seconds([pid]) - ticks0)
    return out


def cpu_by_thread(before: CpuSnapshot, pids: list[int]) -> dict[str, float]:
    """CPU seconds since `before` of the threads of `pids` (in this order: "r0", "r1", ...),
    summed by thread name (`comm`: the OS name, "python3" for the interpreter's threads, whose
    `threading` names the OS does not see), e.g. {"r0:python3": 0.21}."""
    out: dict[str, float] = {}
    for i, pid in enumerate(pids):
        ns0 = before.get(pid, (0.0, {}))[1]
        for tid, ns in _thread_ns(pid).items():
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
            except OSError:
                name = "?"
            key = f"r{i}:{name}"
            out[key] = out.get(key, 0.0) + (ns - ns0.get(tid, 0)) / 1e9
    return out


def cpu_since(before: CpuSnapshot) -> float:
    """CPU seconds all the processes of `before` used since (cpu_since_by_pid)."""
    return sum(cpu_since_by_pid(before).values())


def disk_read_bytes(pid: int) -> int:
    """Bytes this process caused to be read from the disk (`read_bytes` of /proc/PID/io)."""
    try:
        with open(f"/proc/{pid}/io") as f:
            return next(int(v) for k, v in (ln.split(":") for ln in f) if k == "read_bytes")
    except (OSError, StopIteration):
        return 0


def make_tree(src: Path, n: int, seed: int = 11) -> list[str]:
    """n incompressible files of 90-130 KB in 20 directories (reused when complete)."""
    rels = [f"d{i % 20:02d}/f{i:05d}.jpg" for i in range(n)]
    if all((src / r).exists() for r in rels):
        return rels
    rng = random.Random(seed)
    for r in rels:
        p = src / r
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(rng.randbytes(rng.randint(90_000, 130_000)))
    return rels


def prep_tree(work: Path, n: int) -> tuple[Path, Path, list[str]]:
    """`make_tree` under WORK/src, then a fresh zstd prep of it into WORK/dest (8 partitions)."""
    work.mkdir(parents=True, exist_ok=True)
    src, dest = work / "src", work / "dest"
    rels = make_tree(src, n)
    cmd, cenv, why = cli_command()
    if cmd is None:
        raise SystemExit(why)
    rm_rf(dest)
    run_cmd([*cmd, "prep", str(src), str(dest), "--partitions", "8", "--codec", "zstd", "--quiet"],
            env={**os.environ, **cenv})
    return src, dest, rels


def read_files(root: str, rels: list[str], seed: int = 1, readers: int = 1) -> list[float]:
    """Read each file whole with one reader, in a shuffled order (an epoch's; the same order
    as bench.smallfile's single reader); seconds per file (open to close). With `readers`,
    that many threads read every `readers`-th file of the order each (a DataLoader's workers).

    Not in `rels`' order: that walks the 20 directories in turn, 20 sequential streams
    through the image or partitions, which the disk's read-ahead mostly prefetches: "cold"
    would measure a prefetched scan, not an epoch's random reads."""
    order = list(rels)
    random.Random(seed).shuffle(order)

    def read(part: list[str]) -> list[float]:
        out = []
        for r in part:
            t0 = time.perf_counter()
            with open(os.path.join(root, r), "rb", buffering=0) as f:
                while f.read(1 << 20):
                    pass
            out.append(time.perf_counter() - t0)
        return out

    if readers == 1:
        return read(order)
    with ThreadPoolExecutor(readers) as pool:
        return [t for ts in pool.map(read, [order[i::readers] for i in range(readers)]) for t in ts]


def summary(times: list[float], cpu: float | None = None) -> dict:
    s = sorted(times)
    d = {"files": len(s), "files_per_s": len(s) / sum(s), "p50_us": s[len(s) // 2] * 1e6,
         "p99_us": s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6}
    if cpu is not None:
        d["cpu_us_per_file"] = cpu / len(s) * 1e6
    return d


def remote_to_rank0(dest: Path, rels: list[str]) -> list[str]:
    """The files all of whose blobs rank 1 holds and rank 0 does not (2 ranks, 1 replica)."""
    sys.path.insert(0, str(REPO / "src"))
    from fanstore_fuse._format import MANIFEST_NAME
    from fanstore_fuse._manifest import read_manifest
    from fanstore_fuse._namespace import Namespace
    from fanstore_fuse._ring import Placement

    m = read_manifest(str(dest / MANIFEST_NAME))
    parts, bpart = m.partitions, m.blobs["part"]
    pl = Placement(2, 1, is_broadcast=lambda b: parts[bpart[b]].broadcast)
    ns = Namespace(m)
    out = []
    for r in rels:
        blobs = ns.blobs(ns.resolve(b"/" + r.encode()))
        if len(blobs) and all(not pl.holds(0, b) for b in blobs):
            out.append(r)
    return out


class Fan:
    """One fanstore-fuse mount (1 or 2 ranks) driven through the CLI."""

    def __init__(self, work: Path, dest: Path, tag: str, ranks: int, extra: list[str], env: dict):
        self.cmd, cenv, why = cli_command()
        if self.cmd is None:
            raise SystemExit(why)
        self.env = {**os.environ, **cenv, **env, "FANSTORE_STATE_DIR": str(work / "state")}
        base = work / f"mnt-{tag}"
        self.arg = str(base / "{rank}") if ranks > 1 else str(base)
        self.mps = [self.arg.format(rank=r) for r in range(ranks)]
        loc = str(work / f"local-{tag}" / "{rank}") if ranks > 1 else str(work / f"local-{tag}")
        for mp in self.mps:
            Path(mp).mkdir(parents=True, exist_ok=True)
        rm_rf(work / f"local-{tag}")
        self.local = work / f"local-{tag}"  # the daemons' local copies
        self.marker = str(base)
        self.mounts = [register(Mount(mp, umount_cmd=[*self.cmd, "umount", mp] if i == 0 else None,
                                      pid_marker=self.marker if i == 0 else None))
                       for i, mp in enumerate(self.mps)]
        args = ["mount", str(dest), self.arg, "--local", loc, *extra]
        if ranks > 1:
            args += ["--ranks", str(ranks)]
        self.command = "fanstore-fuse " + " ".join(args)
        run_cmd([*self.cmd, *args], timeout=300, env=self.env)
        for mp in self.mps:
            wait_mounted(mp, 300)

    def pids(self) -> list[int]:
        return pids_with_arg(self.marker)

    def close(self) -> None:
        for m in self.mounts:
            for p in teardown(m):
                log(f"teardown: {p}")


def measure_fan(fan: Fan, root: str, rels: list[str], cold: bool, readers: int = 1) -> dict:
    if cold:
        drop_caches()
    pids = fan.pids()
    daemons = daemon_pids(fan.marker)
    before = cpu_snapshot(pids)
    disk = {p: disk_read_bytes(p) for p in daemons}
    vm0 = _vmnoise.snapshot()
    times = read_files(root, rels, readers=readers)
    used = cpu_since_by_pid(before)
    res = summary(times, sum(used.values()))
    res["vm"] = _vmnoise.since(vm0)
    # per daemon (in rank order) and the rest (mpiexec, hydra proxy)
    res["cpu_us_per_file_by_daemon"] = [used[p] / len(rels) * 1e6 for p in daemons if p in used]
    # whether a cold pass was cold: the disk bytes each daemon read, per file
    res["disk_bytes_per_file_by_daemon"] = [round((disk_read_bytes(p) - b) / len(rels))
                                            for p, b in disk.items()]
    res["cpu_us_per_file_other"] = sum(v for p, v in used.items() if p not in daemons) / len(rels) * 1e6
    res["cpu_us_per_file_by_thread"] = {k: round(v / len(rels) * 1e6, 1)
                                        for k, v in cpu_by_thread(before, daemons).items()}
    return res


# Warm passes of 2,000 files take 0.1-0.2 s: the writable / read-only bar compares two equal
# costs (the same requests per file), whose passes swing +-20% on this VM, so it takes many
# interleaved rounds (3 cycles of 7) and the median of the per-round ratios, as bench.epoch2.
WARM_ROUNDS_PER_CYCLE = 7


def requests_answered(fan: Fan) -> int:
    """FUSE requests the mount's daemon answered so far (`status`: `stats.requests`)."""
    stats = json.loads(os.getxattr(fan.mps[0], "user.fanstore.status"))["ranks"][0]["stats"]
    return int(stats.get("requests", 0))


def best_of(fan: Fan, rels: list[str], rounds: int) -> list[dict]:
    return [measure_fan(fan, fan.mps[0], rels, cold=False) for _ in range(rounds)]


def median(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda d: d["files_per_s"])[len(runs) // 2]


def squash(work: Path, src: Path, rels: list[str]) -> dict:
    """Cold and warm reads through squashfuse and squashfuse_ll over one zstd image."""
    out: dict = {}
    if not shutil.which("mksquashfs"):
        return {"error": "mksquashfs not installed"}
    image = work / "data.sqfs"
    if not image.exists():
        run_cmd(["mksquashfs", str(src), str(image), "-comp", "zstd", "-noappend", "-no-progress"])
    for exe in ("squashfuse", "squashfuse_ll"):
        path = shutil.which(exe)
        if not path:
            out[exe] = {"error": f"{exe} not installed"}
            continue
        mp = work / f"mnt-{exe}"
        mp.mkdir(exist_ok=True)
        proc = subprocess.Popen([path, "-f", str(image), str(mp)], stderr=subprocess.PIPE, text=True)
        m = register(Mount(str(mp), procs=[proc]))
        try:
            wait_mounted(mp, 60, proc)
            drop_caches()
            c0 = cpu_snapshot([proc.pid])
            cold = summary(read_files(str(mp), rels), cpu_since(c0))
            read_files(str(mp), rels)
            c0 = cpu_snapshot([proc.pid])
            warm = summary(read_files(str(mp), rels), cpu_since(c0))
            out[exe] = {"cold": cold, "warm": warm}
        finally:
            teardown(m)
    return out


def run_remote(work: Path, dest: Path, rels: list[str], envs: list[dict], rounds: int,
               profile: bool = False, readers: int = 1) -> list[dict]:
    """Remote-only reads through rank 0 of 2, one mount per daemon environment, all mounted at
    once and read in interleaved cold passes (a 1 MiB blob cache: every pass fetches again);
    the pass with the median CPU per file of each. First in the result, the anchor measured the
    same way in the same rounds: the same files read cold through a 1-rank mount (all local),
    so that the remote/local ratio compares passes that the machine's drift touched alike."""
    # the disk cache of remote blobs off: every pass must fetch remotely (bench.epoch2 has it on)
    base = {"FANSTORE_CACHE_BYTES": "1048576", "FANSTORE_CACHE_SIZE": "0"}
    fans = [Fan(work, dest, "l1i", 1, ["--read-only"], base)]
    fans += [Fan(work, dest, f"r2e{i}", 2, ["--read-only"], {**base, **env})
             for i, env in enumerate(envs)]
    try:
        runs: list[list[dict]] = [[] for _ in fans]
        for _ in range(rounds):
            for fan, r in zip(fans, runs, strict=True):
                r.append(measure_fan(fan, fan.mps[0], rels, cold=True, readers=readers))
        out = []
        for fan, env, r in zip(fans, [{}, *envs], runs, strict=True):
            res = sorted(r, key=lambda d: d["cpu_us_per_file"])[len(r) // 2]
            # each pass over the local pass of its own round: the VM drifts over minutes, so
            # passes of one round compare best (the bar: their median, as bench.epoch2's)
            res.update(round_ratios={k: [round(d[k] / max(a[k], 1e-9), 3) for d, a in
                                         zip(r, runs[0], strict=True)]
                                     for k in ("cpu_us_per_file", "p50_us")})
            res.update(command=fan.command, env=env,
                       cpu_us_per_file_runs=[round(d["cpu_us_per_file"]) for d in r],
                       p50_us_runs=[round(d["p50_us"]) for d in r],
                       p99_us_runs=[round(d["p99_us"]) for d in r],
                       disk_bytes_per_file_runs=[d["disk_bytes_per_file_by_daemon"] for d in r],
                       stolen_ms_runs=[d["vm"].get("stolen_ms") for d in r])
            out.append(res)
        if profile:  # an extra pass (sampling costs CPU): its figures are not reported
            drop_caches()
            with Profiler(daemon_pids(fans[1].marker), work / "profile-r2") as prof:
                read_files(fans[1].mps[0], rels)
            out[1]["profile"] = {str(p): summarize([f]) for p, f in
                                 zip(prof.pids, prof.files, strict=False)} or prof.error
        return out
    finally:
        for fan in fans:
            fan.close()


def project(res: dict) -> dict:
    """Scale model rows with the measured CPU per file (one daemon core per node)."""
    costs = dict(_projection.DEFAULT_COSTS)
    local, remote = res.get("local_cold_same") or res["local_cold"], res["remote_cold"]
    costs["local_files_s"] = 1e6 / local["cpu_us_per_file"]
    # every node serves as many remote reads as it makes: client + server CPU per remote file
    costs["remote_files_s"] = 1e6 / remote["cpu_us_per_file"]
    costs["remote_latency_s"] = remote["p50_us"] * 1e-6
    imbalance = _ringsim.imbalances([1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    out = {"costs": costs}
    for key, demand in (("paper", 550.0), ("modern", 20000.0)):
        rows = _projection.project(costs, imbalance, demand)
        _projection.print_projection(f"PROJECTION from measured CPU per file, {key}", rows, demand)
        out[key] = rows
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cost", description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--work", default="/tmp/fanstore-bench-cost")
    ap.add_argument("--json", default=str(REPO / "bench" / "out" / "cost.json"))
    ap.add_argument("--ab", action="append", default=[], metavar="KEY=VALUE",
                    help="also measure remote reads with this daemon environment, K=V[,K2=V2] (repeatable)")
    ap.add_argument("--no-squashfuse", action="store_true")
    ap.add_argument("--no-large", action="store_true", help="skip remote large reads vs raw MPI")
    ap.add_argument("--only-large", action="store_true", help="only remote large reads vs raw MPI")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the remote large reads")
    ap.add_argument("--cold-rounds", type=int, default=5,
                    help="rounds of the interleaved remote and local cold passes")
    ap.add_argument("--profile", action="store_true", help="py-spy the remote read (extra run)")
    ap.add_argument("--readers", type=int, default=1,
                    help="concurrent readers of the remote passes and their local anchor (1: the bar)")
    args = ap.parse_args(argv)
    work = Path(args.work)
    from . import _large  # (it uses this module's Fan)

    if args.only_large:
        try:
            large = {"large": _large.run_large(work, work, args.rounds), "loadavg": os.getloadavg()}
        finally:
            teardown_all()
        print(json.dumps(large))
        _large.print_large(large["large"])
        return 0
    src, dest, rels = prep_tree(work, args.files)
    res: dict = {"files": len(rels), "loadavg_start": os.getloadavg()}
    try:
        # the default (writable) mount and --read-only: both mounted, warm passes interleaved
        fans = {"writable": Fan(work, dest, "rw", 1, [], {}),
                "read_only": Fan(work, dest, "ro", 1, ["--read-only"], {})}
        try:
            res["local_cold"] = measure_fan(fans["read_only"], fans["read_only"].mps[0], rels, True)
            res["writable_cold"] = measure_fan(fans["writable"], fans["writable"].mps[0], rels, True)
            # Warm passes in cycles, one per mount: caches dropped, every mount's page cache
            # filled the same way (its daemon's local copy read in, then one unmeasured pass),
            # this cycle's mount first, then interleaved passes. On this VM the mount filled
            # first after a drop reads warm slower, whatever its mode (the reader's read() of
            # the same page-cache bytes, with the same FUSE requests), so every mount takes
            # that place once; and no mount's first warm pass follows another's drop_caches.
            runs: dict[str, list[dict]] = {k: [] for k in fans}
            asked = {k: 0 for k in fans}  # FUSE requests in the measured passes
            names = list(fans)
            for c in range(len(names)):
                drop_caches()
                for k in names[c:] + names[:c]:
                    read_copy(fans[k].local)
                    read_files(fans[k].mps[0], rels)
                for _ in range(WARM_ROUNDS_PER_CYCLE):
                    for k, fan in fans.items():
                        before = requests_answered(fan)
                        runs[k] += best_of(fan, rels, 1)
                        asked[k] += requests_answered(fan) - before
            for k in fans:  # what each mount was asked per warm file
                res[f"{k}_warm_requests_per_file"] = round(asked[k] / (len(rels) * len(runs[k])), 2)
            for k, v in runs.items():
                res[f"{k}_warm"] = median(v)
                res[f"{k}_warm_runs"] = [round(d["files_per_s"]) for d in v]
            res["writable_read_only_round_ratios"] = sorted(
                round(w["files_per_s"] / r["files_per_s"], 3)
                for w, r in zip(runs["writable"], runs["read_only"], strict=True))
            log(f"1 rank: {res}")
        finally:
            for fan in fans.values():
                fan.close()
        remote = remote_to_rank0(dest, rels)
        log(f"{len(remote)} of {len(rels)} files are held by rank 1 only")
        envs = [{}] + [dict(kv.split("=", 1) for kv in ab.split(",")) for ab in args.ab]
        res["readers"] = args.readers
        res["local_cold_same"], res["remote_cold"], *res["remote_ab"] = run_remote(
            work, dest, remote, envs, args.cold_rounds, args.profile, args.readers)
        log(f"2 ranks, remote only: {res['remote_cold']}")
        if not args.no_large:
            res["large"] = _large.run_large(work, src.parent, args.rounds)
            log(f"remote large reads: {res['large']}")
        if not args.no_squashfuse:
            res["squashfuse"] = squash(work, src, rels)
    finally:
        teardown_all()
    res["loadavg_end"] = os.getloadavg()
    print_table(res)
    res["scale"] = project(res)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    return 0


def print_table(res: dict) -> None:
    many = f", {res['readers']} readers" if res.get("readers", 1) > 1 else ""
    print(f"\nCOST per file read, one reader, {res['files']} files of 90-130 KB "
          f"(load average {res['loadavg_start'][0]:.1f} -> {res['loadavg_end'][0]:.1f})")
    print(f"  {'':38} {'files/s':>9} {'p50 us':>8} {'p99 us':>8} {'CPU us/file':>12}")
    rows = [("1 rank --read-only, cold (local)", res.get("local_cold")),
            ("1 rank writable (default), cold", res.get("writable_cold")),
            ("1 rank, the remote set, cold (interleaved)" + many, res.get("local_cold_same")),
            ("2 ranks, remote files only, cold" + many, res.get("remote_cold"))]
    rows += [(f"  same with {' '.join(f'{k}={v}' for k, v in r['env'].items())}", r)
             for r in res.get("remote_ab", [])]
    rows += [("1 rank --read-only, warm", res.get("read_only_warm")),
             ("1 rank writable (default), warm", res.get("writable_warm"))]
    for exe, d in (res.get("squashfuse") or {}).items():
        if isinstance(d, dict) and "cold" in d:
            rows += [(f"{exe}, cold", d["cold"]), (f"{exe}, warm", d["warm"])]
    for label, d in rows:
        if d:
            print(f"  {label:38} {d['files_per_s']:>9,.0f} {d['p50_us']:>8,.0f} "
                  f"{d['p99_us']:>8,.0f} {d.get('cpu_us_per_file', 0):>12,.0f}")
    lc, rc = res.get("local_cold"), res.get("remote_cold")
    if rc:
        by = ", ".join(f"rank {i} {v:,.0f}" for i, v in enumerate(rc["cpu_us_per_file_by_daemon"]))
        print(f"  remote CPU us/file by daemon: {by}; mpiexec+proxy {rc['cpu_us_per_file_other']:,.0f}")
        for r in [rc, *res.get("remote_ab", [])]:
            print(f"  remote CPU us/file per pass {r['env'] or 'default'}: {r['cpu_us_per_file_runs']}; "
                  f"p50 us {r.get('p50_us_runs')}, p99 us {r.get('p99_us_runs')}; "
                  f"disk bytes/file read by rank 0, 1: {r['disk_bytes_per_file_runs']}; "
                  f"ms stolen by the VM's host {r.get('stolen_ms_runs')}")
    if lc:
        print(f"  local disk bytes/file read by the daemon: {lc['disk_bytes_per_file_by_daemon']}")
    ls = res.get("local_cold_same")
    if ls and rc:
        print(f"  local CPU us/file per pass (the remote set, interleaved with the remote passes): "
              f"{ls['cpu_us_per_file_runs']}; ms stolen by the VM's host {ls.get('stolen_ms_runs')}")
        rr = rc["round_ratios"]
        cpu, p50 = (sorted(rr[k])[len(rr[k]) // 2] for k in ("cpu_us_per_file", "p50_us"))
        print(f"  remote/local, the same files, each pass over its round's local pass: CPU "
              f"{rr['cpu_us_per_file']}, p50 {rr['p50_us']}")
        print(f"  remote/local, median of the {len(rr['p50_us'])} per-round ratios: CPU {cpu:.2f}x "
              f"(bar <= 1.5x: {'PASS' if cpu <= 1.5 else 'MISS'}), p50 {p50:.2f}x (bar <= 2x: "
              f"{'PASS' if p50 <= 2 else 'MISS'}); of the median passes: CPU "
              f"{rc['cpu_us_per_file'] / ls['cpu_us_per_file']:.2f}x, "
              f"p50 {rc['p50_us'] / ls['p50_us']:.2f}x")
    if lc and rc:
        print(f"  remote/local against the single all-files local pass above: CPU "
              f"{rc['cpu_us_per_file'] / lc['cpu_us_per_file']:.2f}x, "
              f"p50 {rc['p50_us'] / lc['p50_us']:.2f}x")
    if res.get("large"):
        from ._large import print_large

        print_large(res["large"])
    w, r = res.get("writable_warm"), res.get("read_only_warm")
    if w and r:
        print(f"  warm files/s per pass, writable {res['writable_warm_runs']}, "
              f"read-only {res['read_only_warm_runs']}")
        ratios = res["writable_read_only_round_ratios"]
        print(f"  writable/read-only warm files/s: {ratios[len(ratios) // 2]:.2f} (bar >= 0.95; "
              f"median of {len(ratios)} per-round ratios, {ratios[0]:.2f}-{ratios[-1]:.2f}; "
              f"of the median passes {w['files_per_s'] / r['files_per_s']:.2f})")
        print("  warm FUSE requests per file: writable "
              f"{res.get('writable_warm_requests_per_file')}, read-only "
              f"{res.get('read_only_warm_requests_per_file')}")


if __name__ == "__main__":
    sys.exit(main())
