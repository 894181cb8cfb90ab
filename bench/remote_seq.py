"""A sequential reader of a large remote file on a default 2-rank mount: how many times its
chunks travel, disk cache on and off.

    python bench/remote_seq.py --work /tmp/x [--mib 128] [--rounds 2] [--build NAME=PYTHONPATH]

Builds a 256 MiB file (3/4 random, 1/4 text per MiB: framed 4 MiB chunks), preps it, then per
round and per build mounts it with `--ranks 2` twice (disk cache on: the default; off:
`FANSTORE_CACHE_SIZE=0`) and on rank 0: `dd bs=1M` of the first MIB MiB (pass 1, cold), the
same again with the page cache dropped (pass 2), then 200 random 128 KiB preads in the second
half checked against the source. Prints per pass dd's MB/s, rank 0's `status` counters that
moved (`remote_reads` and `remote_bytes`: fetches from rank 1 or DEST; `local_reads`: from its
own disk, the disk cache included; `cache_hits`; `dc_hits`: disk-cache hits; MPI bytes
received) and the two daemons' CPU (utime + stime, /proc/PID/stat) per MiB read.
`--build NAME=DIR` (repeatable) runs the package found in DIR (PYTHONPATH) too, alternating
with the others: A/B in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

SIZE = 256 << 20


def make_data(work: str) -> tuple[str, str]:
    src, dest = os.path.join(work, "src"), os.path.join(work, "dest")
    big = os.path.join(src, "large.bin")
    if not os.path.exists(big):
        os.makedirs(src, exist_ok=True)
        rng = random.Random(5)
        with open(big + ".tmp", "wb") as f:
            for i in range(SIZE >> 20):
                text = b"".join(b"row %08d, value %d\n" % (k, (k * 7 + i) % 97)
                                for k in range((256 << 10) // 24)).ljust(256 << 10, b".")
                f.write(rng.randbytes(768 << 10) + text)
        os.rename(big + ".tmp", big)
    if not os.path.exists(os.path.join(dest, "manifest.fsm")):
        subprocess.run([sys.executable, "-m", "fanstore_fuse", "prep", src, dest, "--partitions", "8",
                        "--quiet"], check=True)
    return dest, big


class Mount:
    def __init__(self, work: str, dest: str, env: dict[str, str]):
        self.env = env
        self.state = env["FANSTORE_STATE_DIR"]
        self.mnt = os.path.join(work, "mnt")
        self.cli = [sys.executable, "-m", "fanstore_fuse"]
        for r in (0, 1):
            os.makedirs(f"{self.mnt}/{r}", exist_ok=True)
        subprocess.run([*self.cli, "mount", dest, self.mnt + "/{rank}", "--ranks", "2", "--local",
                        os.path.join(work, "local", "{rank}")], env=env, check=True,
                       stdout=subprocess.DEVNULL)

    def status(self) -> list[dict]:
        out = subprocess.run([*self.cli, "status", f"{self.mnt}/0", "--json"], env=self.env,
                             check=True, capture_output=True, text=True).stdout
        return sorted(json.loads(out)["ranks"], key=lambda r: r["rank"])

    def pids(self) -> list[int]:
        for name in os.listdir(self.state):
            if name.endswith(".json"):
                with open(os.path.join(self.state, name)) as f:
                    st = json.load(f)
                if len(st.get("pids", [])) == 2:
                    return list(st["pids"])
        raise SystemExit("no daemon pids in the state dir")

    def umount(self) -> None:
        for r in (0, 1):
            subprocess.run([*self.cli, "umount", f"{self.mnt}/{r}"], env=self.env, capture_output=True)


def cpu_s(pids: list[int]) -> float:
    t = 0
    for p in pids:
        with open(f"/proc/{p}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        t += int(fields[11]) + int(fields[12])
    return t / os.sysconf("SC_CLK_TCK")


def counts(r: dict) -> dict[str, int]:
    s, d = r["stats"], r.get("disk_cache", {})
    return {"remote_reads": s.get("remote_reads", 0), "remote_bytes": s.get("remote_bytes", 0),
            "local_reads": s.get("local_reads", 0), "cache_hits": s.get("cache_hits", 0),
            "dc_hits": d.get("hits", 0), "mpi_bytes_received": r.get("mpi_bytes_received", 0)}


def one(work: str, dest: str, big: str, mib: int, env: dict[str, str], label: str) -> None:
    m = Mount(work, dest, env)
    try:
        pids, path = m.pids(), f"{m.mnt}/0/large.bin"
        for pas in (1, 2):
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
            a, c0 = counts(m.status()[0]), cpu_s(pids)
            dd = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=1M", f"count={mib}"],
                                capture_output=True, text=True).stderr.strip().splitlines()[-1]
            c1 = cpu_s(pids)
            time.sleep(1.5)  # the disk cache's writer
            b = counts(m.status()[0])
            d = {k: b[k] - a[k] for k in b}
            print(f"{label} pass{pas}: {dd.rsplit(',', 1)[-1].strip():>10}  cpu "
                  f"{(c1 - c0) / mib * 1e3:5.2f} ms/MiB  {d}", flush=True)
        a = counts(m.status()[0])
        rng = random.Random(1)
        fd = os.open(path, os.O_RDONLY)
        with open(big, "rb") as src:
            for _ in range(200):
                off = rng.randrange(SIZE // 2, SIZE, 4096)
                src.seek(off)
                if os.pread(fd, 128 << 10, off) != src.read(128 << 10):
                    raise SystemExit(f"{label}: wrong bytes at {off}")
        os.close(fd)
        b = counts(m.status()[0])
        print(f"{label} random (verified): {({k: b[k] - a[k] for k in b})}", flush=True)
    finally:
        m.umount()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True)
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--build", action="append", default=[], help="NAME=PYTHONPATH (repeatable)")
    ap.add_argument("--cache", default="on,off", help="disk cache settings to run: on,off")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    dest, big = make_data(a.work)
    builds = [("this", os.environ.get("PYTHONPATH", ""))] + [tuple(b.split("=", 1)) for b in a.build]
    for _ in range(a.rounds):
        for name, pypath in builds:
            for cache in a.cache.split(","):
                env = dict(os.environ, FANSTORE_STATE_DIR=os.path.join(a.work, "state"))
                if pypath:
                    env["PYTHONPATH"] = pypath
                if cache == "off":
                    env["FANSTORE_CACHE_SIZE"] = "0"
                print(f"# {time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}", flush=True)
                one(a.work, dest, big, a.mib, env, f"{name:>6} cache {cache:>3}")


if __name__ == "__main__":
    main()
