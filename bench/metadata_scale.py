"""Metadata-scale workload (issue 14): many tiny files, measured through the real CLI.

    python -m bench.metadata_scale --files 20000 --files 100000 [--work DIR] [--out FILE.json]

For each size: generate a tree of N files of 64-512 B in N/1282 directories (ImageNet-1k shape at
1,281,167), then report prep and verify peak RSS (os.wait4 of the CLI), mount time and private
memory per daemon (Private_Clean + Private_Dirty from /proc/PID/smaps_rollup, plus Anonymous)
for 1 and 3 ranks after every file was stat'ed once, `find -type f | wc -l` on the mount vs the
source tree (warm page cache: dropping caches would disturb others on a shared machine), and
local disk per rank (`st_blocks` of the local dirs). With two sizes it extrapolates every
figure linearly to 14.2M files.
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
    out = subprocess.run(f"find {path} -type f | wc -l", shell=True, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    return dt if out.returncode == 0 else float("nan")


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


def one_mount(dest: Path, work: Path, ranks: int, env: dict[str, str], n: int) -> dict:
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
        pids = daemon_pids(state)
        res["cpu_at_ready_s"] = [cpu_s(p) for p in pids]
        time.sleep(1.0)  # let warm-up (if any) run
        res["ready_kib"] = [private_kib(p) for p in pids]
        mp0 = Path(mp.replace("{rank}", "0"))
        res["find_s"] = timed_find(mp0)
        res["find_again_s"] = timed_find(mp0)
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


def run_size(n: int, work: Path) -> dict:
    src, dest = work / f"src-{n}", work / f"dest-{n}"
    t0 = time.perf_counter()
    generate(src, n)
    gen_s = time.perf_counter() - t0
    env = dict(os.environ)
    shutil.rmtree(dest, ignore_errors=True)
    prep_s, prep_rss = measured(["prep", str(src), str(dest), "--partitions", "16", "--workers", "2",
                                 "--quiet"], env)
    verify_s, verify_rss = measured(["verify", str(dest)], env)
    res = {"files": n, "generate_s": gen_s, "prep_s": prep_s, "prep_peak_rss": prep_rss,
           "verify_s": verify_s, "verify_peak_rss": verify_rss,
           "manifest_bytes": (dest / "manifest.fsm").stat().st_size,
           "data_bytes": sum(p.stat().st_size for p in dest.glob("*.fsp"))}
    t0 = time.perf_counter()
    res["native_find_s"] = timed_find(src)
    res["native_walk_stat_s"] = (stat_all(src), time.perf_counter() - t0)[1]
    for ranks in (1, 3):
        res[f"ranks{ranks}"] = one_mount(dest, work / f"m{n}", ranks, env, n)
    return res


def _private(k: dict[str, int]) -> int:
    return k["Private_Clean"] + k["Private_Dirty"]


def table(results: list[dict]) -> str:
    rows = [("files", lambda r: f"{r['files']:,}")]
    rows += [
        ("prep s / peak RSS MiB", lambda r: f"{r['prep_s']:.1f} / {r['prep_peak_rss'] >> 20}"),
        ("verify s / peak RSS MiB", lambda r: f"{r['verify_s']:.1f} / {r['verify_peak_rss'] >> 20}"),
        ("manifest MB", lambda r: f"{r['manifest_bytes'] / 1e6:.1f}"),
    ]
    for k in (1, 3):
        rows += [
            (f"mount {k} rank(s) s (daemon CPU s at ready)", lambda r, k=k: "{:.2f} ({})".format(
                r[f"ranks{k}"]["mount_s"], ", ".join(f"{x:.2f}" for x in r[f"ranks{k}"]["cpu_at_ready_s"]))),
            (f"{k}r private MiB per daemon, ready (anon)", lambda r, k=k: ", ".join(
                f"{_private(x) >> 10} ({x['Anonymous'] >> 10})" for x in r[f"ranks{k}"]["ready_kib"])),
            (f"{k}r private MiB per daemon, all stat'ed (anon)", lambda r, k=k: ", ".join(
                f"{_private(x) >> 10} ({x['Anonymous'] >> 10})" for x in r[f"ranks{k}"]["after_stat_kib"])),
            (f"{k}r find s (again) / native", lambda r, k=k: "{:.2f} ({:.2f}) / {:.2f}".format(
                r[f"ranks{k}"]["find_s"], r[f"ranks{k}"]["find_again_s"], r["native_find_s"])),
            (f"{k}r walk+stat s / native", lambda r, k=k: "{:.2f} / {:.2f}".format(
                r[f"ranks{k}"]["walk_stat_s"], r["native_walk_stat_s"])),
            (f"{k}r local partitions KiB per rank", lambda r, k=k: ", ".join(
                str(x) for x in r[f"ranks{k}"]["local_disk_kib"]) + f" (of {r['data_bytes'] >> 10})"),
        ]
    out = ["| | " + " | ".join(f"{r['files']:,} files" for r in results) + " |",
           "|---|" + "---|" * len(results)]
    for name, f in rows[1:]:
        out.append(f"| {name} | " + " | ".join(f(r) for r in results) + " |")
    if len(results) >= 2:
        a, b = results[-2], results[-1]

        def ext(get) -> str:
            ya, yb = get(a), get(b)
            slope = (yb - ya) / (b["files"] - a["files"])
            return f"{yb + slope * (TARGET - b['files']):,.0f}"

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
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, action="append", default=None)
    ap.add_argument("--work", default="/tmp/fanstore-metadata-bench")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sizes = a.files or [5000]
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    results = [run_size(n, work) for n in sizes]
    text = table(results)
    print(text)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
