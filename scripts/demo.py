#!/usr/bin/env python3
"""`make demo`: build a small sample dataset, prep it, mount it, read every file back through the
mount comparing bytes, print a summary, unmount, and check nothing is left behind.

With a CLI that supports `mount --ranks`, the dataset is mounted on 3 local ranks standing in
for 3 nodes; files are read through all of them, so some reads are remote (see the status
counters). Exits non-zero on any mismatch or leftover.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLI = [sys.executable, "-m", "fanstore_fuse"]
CHUNK_MIB = 1


def run(
    *args: str, env: dict[str, str], check: bool = True, show: bool = True
) -> subprocess.CompletedProcess[str]:
    if show:
        print("$ fanstore-fuse " + " ".join(shlex.quote(a) for a in args), flush=True)
    r = subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, errors="replace",
                       stdin=subprocess.DEVNULL, timeout=600)
    out = (r.stdout + r.stderr).strip()
    if show and out and args[0] != "status":
        print("  " + out.replace("\n", "\n  "), flush=True)
    if check and r.returncode != 0:
        raise SystemExit(f"demo: `fanstore-fuse {' '.join(args)}` failed (exit {r.returncode}):\n{out}")
    return r


def build_dataset(root: Path, seed: int = 2024) -> tuple[int, int]:
    """A deterministic image-classification-like tree: train/<class>/*.bin, val/*.txt,
    a multi-chunk file, a symlink, an empty file. Returns (files, bytes)."""
    rng = random.Random(seed)
    files = nbytes = 0

    def put(p: Path, data: bytes) -> None:
        nonlocal files, nbytes
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        os.utime(p, ns=(1_700_000_000_000_000_000 + files, 1_700_000_000_000_000_000 + files))
        files += 1
        nbytes += len(data)

    for c in range(8):
        for k in range(40):
            if k % 4 == 0:  # compressible: repetitive "annotations"
                data = (f"class {c} sample {k} label {c * 40 + k}\n" * rng.randint(20, 400)).encode()
            else:  # incompressible: random "JPEG" bytes
                data = rng.randbytes(rng.randint(2_000, 60_000))
            put(root / "train" / f"class_{c:02d}" / f"img_{k:04d}.bin", data)
    for k in range(40):
        put(root / "val" / f"val_{k:04d}.txt", f"validation {k}\n".encode() * rng.randint(1, 50))
    put(root / "weights" / "model.bin", rng.randbytes((3 * CHUNK_MIB << 20) + 123_457))  # 4 chunks
    put(root / "README empty", b"")
    os.symlink("train/class_00", root / "first-class")
    os.symlink("weights/model.bin", root / "latest.bin")
    return files, nbytes


def has_ranks_option(env: dict[str, str]) -> bool:
    r = run("mount", "--help", env={**env, "COLUMNS": "200"}, check=False, show=False)
    return r.returncode == 0 and "--ranks" in r.stdout


def fuse_mounts() -> set[str]:
    from fanstore_fuse._mountctl import fuse_mounts as table

    return set(table())


def read_back(src: Path, mounts: list[Path]) -> tuple[int, int, float, list[str]]:
    """Read every file through the mounts (file k through mount k % len), compare bytes and
    metadata; return (files, bytes, seconds, problems)."""
    problems: list[str] = []
    files = nbytes = 0
    rels = []
    for dp, dns, fns in os.walk(src):
        dns.sort()
        for n in sorted(fns + [d for d in dns if os.path.islink(os.path.join(dp, d))]):
            rels.append(os.path.relpath(os.path.join(dp, n), src))
    t0 = time.perf_counter()
    for k, rel in enumerate(rels):
        s, m = src / rel, mounts[k % len(mounts)] / rel
        ss, ms = os.lstat(s), os.lstat(m)
        if (stat.S_IFMT(ss.st_mode), stat.S_IMODE(ss.st_mode), ss.st_size, ss.st_mtime_ns) != (
            stat.S_IFMT(ms.st_mode), stat.S_IMODE(ms.st_mode), ms.st_size, ms.st_mtime_ns
        ):
            problems.append(f"{rel}: metadata differs")
        if stat.S_ISLNK(ss.st_mode):
            if os.readlink(s) != os.readlink(m):
                problems.append(f"{rel}: symlink target differs")
            continue
        data = m.read_bytes()
        if data != s.read_bytes():
            problems.append(f"{rel}: BYTES DIFFER")
        files += 1
        nbytes += len(data)
    dt = time.perf_counter() - t0
    for mp in mounts:
        if sorted(os.listdir(mp)) != sorted(os.listdir(src)):
            problems.append(f"{mp}: root listing differs")
    return files, nbytes, dt, problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=3, help="local ranks when the CLI supports them")
    ap.add_argument("--single", action="store_true", help="force a single-node mount")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="fanstore-demo-"))
    env = dict(os.environ, FANSTORE_STATE_DIR=str(work / "state"), COLUMNS="250")
    src, dest = work / "dataset", work / "prepped"
    multi = not args.single and has_ranks_option(env)
    ranks = args.ranks if multi else 1
    template = str(work / "mnt" / "{rank}") if multi else str(work / "mnt")
    local = str(work / "local" / "{rank}") if multi else str(work / "local")
    mounts = [Path(template.replace("{rank}", str(r))) for r in range(ranks)]
    for mp in mounts:
        mp.mkdir(parents=True, exist_ok=True)
    ok = False
    mounted = False
    try:
        n_files, n_bytes = build_dataset(src)
        print(f"demo: sample dataset {src}: {n_files} files, {n_bytes / 1e6:.1f} MB, 2 symlinks")
        run("prep", str(src), str(dest), "--partitions", "4", "--chunk-mib", str(CHUNK_MIB),
            "--broadcast", "val", "--quiet", env=env)
        print(f"  {sum(1 for _ in dest.iterdir())} files in {dest}: "
              + ", ".join(sorted(p.name for p in dest.iterdir())))
        run("verify", str(dest), env=env)
        margs = ["mount", str(dest), template, "--local", local]
        if multi:
            margs += ["--ranks", str(ranks)]
        t0 = time.perf_counter()
        mounted = True
        run(*margs, env=env)
        print(f"  mounted in {time.perf_counter() - t0:.2f} s"
              + (f" on {ranks} local ranks (one daemon each, standing in for nodes)" if multi else ""))
        files, nbytes, dt, problems = read_back(src, mounts)
        st = json.loads(run("status", template, "--json", env=env).stdout)
        rank_stats = st.get("ranks", [st])
        tot: dict[str, int] = {}
        for r in rank_stats:
            for k, v in r.get("stats", {}).items():
                if isinstance(v, int):
                    tot[k] = tot.get(k, 0) + v
        print(f"demo: read {files} files, {nbytes / 1e6:.1f} MB back through "
              f"{len(mounts)} mount(s) in {dt:.2f} s: {nbytes / 1e6 / dt:.1f} MB/s, {files / dt:.0f} files/s")
        keys = ("local_reads", "remote_reads", "remote_bytes", "cache_hits", "cache_misses", "errors")
        for r in rank_stats:
            s = r.get("stats", {})
            print(f"  rank {r.get('rank', 0)}: " + ", ".join(f"{k}={s.get(k, 0)}" for k in keys))
        if multi and tot.get("remote_reads", 0) == 0:
            problems.append("no remote reads on a multi-rank mount")
        if tot.get("errors", 0):
            problems.append(f"daemons counted {tot['errors']} errors")
        if files != n_files or nbytes != n_bytes:
            problems.append(f"read {files} files/{nbytes} bytes, expected {n_files}/{n_bytes}")
        # A checkpoint written on the last rank, read on the first right after close.
        ckpt = os.urandom(3 << 20)
        writer, reader = mounts[-1], mounts[0]
        (writer / "outputs").mkdir()
        with open(writer / "outputs" / "model.ckpt", "wb") as f:
            for i in range(0, len(ckpt), 1 << 16):  # many small writes, as torch.save does
                f.write(ckpt[i : i + (1 << 16)])
        same = (reader / "outputs" / "model.ckpt").read_bytes() == ckpt
        print(f"demo: wrote a {len(ckpt) >> 20} MiB checkpoint through {writer}; read back through "
              f"{reader}: {'identical' if same else 'DIFFERENT'}")
        if not same:
            problems.append("checkpoint differs when read on another rank")
        for p in problems:
            print(f"demo: MISMATCH {p}", file=sys.stderr)
        ok = not problems
    finally:
        if mounted:
            staged = work / "staged-out"
            r = run("umount", template, "--stage-out", str(staged), env=env, check=False)
            if ok:
                back = (staged / "outputs" / "model.ckpt").read_bytes() if staged.exists() else b""
                print(f"demo: umount --stage-out {staged}: checkpoint "
                      f"{'identical' if back == ckpt else 'MISSING OR DIFFERENT'}")
                ok = back == ckpt
            left = [str(mp) for mp in mounts if str(mp) in fuse_mounts()]
            for mp in left:
                subprocess.run(["fusermount3", "-u", "-z", mp], capture_output=True)
            stray = [p for p in (work / "local").glob("*") if p.exists()] if (work / "local").exists() else []
            if r.returncode != 0 or left or stray:
                print(f"demo: umount left mounts {left} / local copies {stray}", file=sys.stderr)
                ok = False
            else:
                print("demo: unmounted; no mount and no local copy left behind")
        if not ok:
            for log in sorted((work / "state").glob("*.log")):
                tail = log.read_text(errors="replace").strip().splitlines()[-15:]
                print(f"--- {log}\n" + "\n".join(tail), file=sys.stderr)
        if args.keep:
            print(f"demo: kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print("demo: OK" if ok else "demo: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
