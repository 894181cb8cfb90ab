"""Metadata-scale workload (issue 14): many tiny files, measured through the real CLI.

    python -m bench.metadata_scale --files 20000 --files 100000 [--work DIR] [--out FILE.json]
        [--reuse] [--cold]

For each size: generate a tree of N files of 64-512 B in N/1282 directories (ImageNet-1k shape at
1,281,167), then report prep and verify peak RSS (os.wait4 of the CLI), mount time and private
memory per daemon (Private_Clean + Private_Dirty from /proc/PID/smaps_rollup, plus Anonymous)
for 1 and 3 ranks after every file was stat'ed once, the longest `stat` right after the mount
returned (a new file each time, while start-up work such as warm-up runs), `find -type f | wc -l`
and a walk + lstat of every file on the mount vs the source tree, and local disk per rank
(`st_blocks` of the local dirs). `--cold` (root) drops the page, dentry and inode caches
(`sync; echo 3 > /proc/sys/vm/drop_caches`) before each traversal, the mount's first ones
included; without it the traversals run warm. `--reuse` keeps an existing WORK/dest-N (prep and
verify not measured then). Each figure is printed against its bar of issue 14 (PASS/MISS); with
two sizes every figure is extrapolated linearly to 14.2M files.
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
from collections.abc import Callable
from pathlib import Path

CLI = [sys.executable, "-m", "fanstore_fuse"]
TARGET = 14_200_000


def generate(root: Path, n: int) -> None:
    done = root.with_name(root.name + ".complete")
    if done.exists():
        return
    shutil.rmtree(root, ignore_errors=True)
    dirs = max(1, round(n / 1282))
    for d in range(dirs):
        (root / f"n{d:08d}").mkdir(parents=True)
    noise = random.Random(1).randbytes(1 << 20)  # incompressible, like JPEG bytes
    for i in range(n):
        size = 64 + (i * 2654435761) % 449
        at = (i * 7919) % ((1 << 20) - 512)
        with open(root / f"n{i % dirs:08d}" / f"n{i % dirs:08d}_{i}.JPEG", "wb") as f:
            f.write(noise[at : at + size])
    done.touch()


def measured(args: list[str], env: dict[str, str]) -> tuple[float, int]:
    """Run the CLI; (seconds, peak RSS bytes of exactly that process)."""
    t0 = time.perf_counter()
    p = subprocess.Popen([*CLI, *args], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    _, status, ru = os.wait4(p.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(args)} failed")
    return time.perf_counter() - t0, ru.ru_maxrss * 1024


def private_kib(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("Rss", "Private_Clean", "Private_Dirty", "Anonymous", "Shared_Clean"):
                out[k] = int(v.split()[0])
    return out


def daemon_pids(state: Path) -> list[int]:
    pids = []
    for f in state.glob("*.json"):
        pids += json.loads(f.read_text()).get("pids", [])
    return sorted(set(pids))


def timed_find(path: Path) -> float:
    t0 = time.perf_counter()
    out = subprocess.run(f"find {path.resolve()} -type f | wc -l", shell=True, capture_output=True,
                         text=True)  # resolved: find does not follow a symlink given as the start
    dt = time.perf_counter() - t0
    return dt if out.returncode == 0 else float("nan")


def drop_caches(cold: bool) -> None:
    """Page cache, dentries and inodes dropped (root only; every process on the machine
    loses its caches, so only for --cold measurements)."""
    if cold:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")


def stat_stalls(root: Path, n: int, seconds: float = 3.0) -> float:
    """The longest lstat (s) of distinct files (each a LOOKUP the daemon answers) during the
    first `seconds` after the mount returned, while start-up work may still run."""
    dirs = max(1, round(n / 1282))
    worst = 0.0
    deadline = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < deadline and i < n:
        d = i % dirs
        t0 = time.perf_counter()
        os.lstat(root / f"n{d:08d}" / f"n{d:08d}_{i}.JPEG")
        worst = max(worst, time.perf_counter() - t0)
        i += 1
    return worst


def stat_all(path: Path) -> int:
    n = 0
    for dp, _dns, fns in os.walk(path):
        for name in fns:
            os.lstat(os.path.join(dp, name))
            n += 1
    return n


def disk_kib(path: Path, pattern: str = "*.fsp") -> int:
    """KiB allocated to the partition copies (the manifest copy is reported on its own)."""
    return sum(p.stat().st_blocks // 2 for p in path.glob(pattern))


def cpu_s(pid: int) -> float:
    """User + system CPU seconds the process used so far (load-independent work)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_mount(dest: Path, work: Path, ranks: int, env: dict[str, str], n: int,
              cold: bool = False) -> dict:
    state = work / f"state-{ranks}"
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True)
    env = {**env, "FANSTORE_STATE_DIR": str(state)}
    mp = str(work / ("mp-{rank}" if ranks > 1 else "mp"))
    local = str(work / ("local-{rank}" if ranks > 1 else "local"))
    for r in range(ranks):
        os.makedirs(mp.replace("{rank}", str(r)), exist_ok=True)
    args = ["mount", str(dest), mp, "--local", local] + (["--ranks", str(ranks)] if ranks > 1 else [])
    t0 = time.perf_counter()
    subprocess.run([*CLI, *args], env=env, check=True, stdin=subprocess.DEVNULL)
    res: dict = {"mount_s": time.perf_counter() - t0}
    try:
        mp0 = Path(mp.replace("{rank}", "0"))
        res["stat_stall_s"] = stat_stalls(mp0, n)
        pids = daemon_pids(state)
        res["cpu_at_ready_s"] = [cpu_s(p) for p in pids]
        res["ready_kib"] = [private_kib(p) for p in pids]
        drop_caches(cold)
        res["find_s"] = timed_find(mp0)
        res["find_again_s"] = timed_find(mp0)
        drop_caches(cold)
        t0 = time.perf_counter()
        res["stat_files"] = stat_all(mp0)
        res["walk_stat_s"] = time.perf_counter() - t0
        assert res["stat_files"] == n, res["stat_files"]
        res["after_stat_kib"] = [private_kib(p) for p in pids]
        res["local_disk_kib"] = [disk_kib(Path(local.replace("{rank}", str(r)))) for r in range(ranks)]
        res["local_manifest_kib"] = disk_kib(Path(local.replace("{rank}", "0")), "*.fsm")
    finally:
        subprocess.run([*CLI, "umount", mp], env=env, check=False, stdin=subprocess.DEVNULL)
    return res


def run_size(n: int, work: Path, reuse: bool = False, cold: bool = False) -> dict:
    src, dest = work / f"src-{n}", work / f"dest-{n}"
    t0 = time.perf_counter()
    generate(src, n)
    gen_s = time.perf_counter() - t0
    env = dict(os.environ)
    res: dict = {"files": n, "generate_s": gen_s, "cold": cold, "load": os.getloadavg()}
    if not (reuse and (dest / "manifest.fsm").exists()):
        shutil.rmtree(dest, ignore_errors=True)
        res["prep_s"], res["prep_peak_rss"] = measured(
            ["prep", str(src), str(dest), "--partitions", "16", "--workers", "2", "--quiet"], env)
        res["verify_s"], res["verify_peak_rss"] = measured(["verify", str(dest)], env)
    res["manifest_bytes"] = (dest / "manifest.fsm").stat().st_size
    res["data_bytes"] = sum(p.stat().st_size for p in dest.glob("*.fsp"))
    drop_caches(cold)
    res["native_find_s"] = timed_find(src)
    drop_caches(cold)
    t0 = time.perf_counter()
    res["native_walk_stat_s"] = (stat_all(src), time.perf_counter() - t0)[1]
    for ranks in (1, 3):
        res[f"ranks{ranks}"] = one_mount(dest, work / f"m{n}", ranks, env, n, cold)
    return res


def _private(k: dict[str, int]) -> int:
    return k["Private_Clean"] + k["Private_Dirty"]


def _get(r: dict, *keys: str) -> float:
    for k in keys:
        r = r[k]
    return float(r)  # type: ignore[arg-type]


def _fmt(r: dict, key: str, fmt: str) -> str:
    return fmt.format(r[key]) if key in r else "(reused)"


def verdicts(r: dict) -> list[str]:
    """Each measured figure of one size against its bar (issue 14)."""
    r1, r3 = r["ranks1"], r["ranks3"]
    share = max(r3["local_disk_kib"]) * 1024 / (r["data_bytes"] / 3)
    rows = [
        ("mount, 1 rank (s)", r1["mount_s"], "<=", 2.0),
        ("mount, 3 ranks (s)", r3["mount_s"], "<=", 5.0),
        ("longest stat right after the mount, 1 rank (ms)", r1["stat_stall_s"] * 1e3, "<=", 50.0),
        ("longest stat right after the mount, 3 ranks (ms)", r3["stat_stall_s"] * 1e3, "<=", 50.0),
        ("find, 3 ranks / native", r3["find_s"] / r["native_find_s"], "<=", 2.0),
        ("walk+stat, native / 3 ranks (speed ratio)", r["native_walk_stat_s"] / r3["walk_stat_s"],
         ">=", 1.0),
        ("3-rank private MiB per daemon, all stat'ed",
         max(_private(x) for x in r3["after_stat_kib"]) / 1024, "<=", 300e6 / 2**20),
        ("local disk per rank / share, 3 ranks", share, "<=", 1.1),
    ]
    if "prep_peak_rss" in r:
        rows += [("prep peak RSS (MiB)", r["prep_peak_rss"] / 2**20, "<=", 1536.0),
                 ("verify peak RSS (MiB)", r["verify_peak_rss"] / 2**20, "<=", 1024.0)]
    out = []
    for name, got, op, bar in rows:
        ok = got <= bar if op == "<=" else got >= bar
        out.append(f"- {'PASS' if ok else 'MISS'} {name}: {got:,.2f} (bar {op} {bar:g})")
    return out


def table(results: list[dict]) -> str:
    cold = "cold" if results[-1].get("cold") else "warm"
    rows: list[tuple[str, Callable[[dict], str]]] = [
        ("prep s / peak RSS MiB", lambda r: _fmt(r, "prep_s", "{:.1f}") + " / "
         + (str(r["prep_peak_rss"] >> 20) if "prep_peak_rss" in r else "-")),
        ("verify s / peak RSS MiB", lambda r: _fmt(r, "verify_s", "{:.1f}") + " / "
         + (str(r["verify_peak_rss"] >> 20) if "verify_peak_rss" in r else "-")),
        ("manifest MB", lambda r: f"{r['manifest_bytes'] / 1e6:.1f}"),
    ]
    for k in (1, 3):
        rows += [
            (f"mount {k} rank(s) s (daemon CPU s at ready)", lambda r, k=k: "{:.2f} ({})".format(
                r[f"ranks{k}"]["mount_s"], ", ".join(f"{x:.2f}" for x in r[f"ranks{k}"]["cpu_at_ready_s"]))),
            (f"{k}r longest stat after mount ms",
             lambda r, k=k: f"{r[f'ranks{k}']['stat_stall_s'] * 1e3:.1f}"),
            (f"{k}r private MiB per daemon, ready (anon)", lambda r, k=k: ", ".join(
                f"{_private(x) >> 10} ({x['Anonymous'] >> 10})" for x in r[f"ranks{k}"]["ready_kib"])),
            (f"{k}r private MiB per daemon, all stat'ed (anon)", lambda r, k=k: ", ".join(
                f"{_private(x) >> 10} ({x['Anonymous'] >> 10})" for x in r[f"ranks{k}"]["after_stat_kib"])),
            (f"{k}r find s (again) / native {cold}", lambda r, k=k: "{:.2f} ({:.2f}) / {:.2f}".format(
                r[f"ranks{k}"]["find_s"], r[f"ranks{k}"]["find_again_s"], r["native_find_s"])),
            (f"{k}r walk+stat s / native {cold}", lambda r, k=k: "{:.2f} / {:.2f}".format(
                r[f"ranks{k}"]["walk_stat_s"], r["native_walk_stat_s"])),
            (f"{k}r local partitions KiB per rank", lambda r, k=k: ", ".join(
                str(x) for x in r[f"ranks{k}"]["local_disk_kib"]) + f" (of {r['data_bytes'] >> 10})"),
        ]
    out = ["| | " + " | ".join(f"{r['files']:,} files" for r in results) + " |",
           "|---|" + "---|" * len(results)]
    for name, f in rows:
        out.append(f"| {name} | " + " | ".join(f(r) for r in results) + " |")
    for r in results:
        out += ["", f"Bars at {r['files']:,} files ({cold}, load average "
                f"{', '.join(f'{x:.1f}' for x in r['load'])} at the start):", *verdicts(r)]
    if len(results) >= 2:
        a, b = results[-2], results[-1]

        def ext(get) -> str:
            try:
                ya, yb = get(a), get(b)
            except KeyError:
                return "-"
            slope = (yb - ya) / (b["files"] - a["files"])
            return f"{yb + slope * (TARGET - b['files']):,.1f}"

        out.append("")
        out.append(f"Linear extrapolation to {TARGET:,} files from {a['files']:,} and {b['files']:,}:")
        out.append(f"- prep peak RSS ≈ {ext(lambda r: r['prep_peak_rss'] / 2**20)} MiB; "
                   f"verify ≈ {ext(lambda r: r['verify_peak_rss'] / 2**20)} MiB; "
                   f"manifest ≈ {ext(lambda r: r['manifest_bytes'] / 1e6)} MB")
        out.append(f"- 3-rank max private MiB per daemon after stat-all ≈ "
                   f"{ext(lambda r: max(_private(x) for x in r['ranks3']['after_stat_kib']) / 1024)}"
                   f" (anonymous ≈ "
                   f"{ext(lambda r: max(x['Anonymous'] for x in r['ranks3']['after_stat_kib']) / 1024)})")
        out.append(f"- daemon CPU at ready, 1 rank ≈ {ext(lambda r: r['ranks1']['cpu_at_ready_s'][0])} s, "
                   f"3 ranks ≈ {ext(lambda r: max(r['ranks3']['cpu_at_ready_s']))} s per daemon")
        out.append(f"- mount wall, 1 rank ≈ {ext(lambda r: _get(r, 'ranks1', 'mount_s'))} s, "
                   f"3 ranks ≈ {ext(lambda r: _get(r, 'ranks3', 'mount_s'))} s; "
                   f"find, 3 ranks ≈ {ext(lambda r: _get(r, 'ranks3', 'find_s'))} s "
                   f"(native ≈ {ext(lambda r: r['native_find_s'])} s)")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, action="append", default=None)
    ap.add_argument("--work", default="/tmp/fanstore-metadata-bench")
    ap.add_argument("--out", default=None)
    ap.add_argument("--reuse", action="store_true", help="keep an existing WORK/dest-N")
    ap.add_argument("--cold", action="store_true", help="drop caches before each traversal")
    a = ap.parse_args()
    sizes = a.files or [5000]
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    results = [run_size(n, work, a.reuse, a.cold) for n in sizes]
    text = table(results)
    print(text)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
