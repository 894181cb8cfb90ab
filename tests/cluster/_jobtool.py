"""Run inside a job on a node (and imported by the tests): compare the mount with the source,
write this node's outputs, read while a peer dies.

    _jobtool.py compare SRC MNT               every entry and byte of MNT equals SRC
    _jobtool.py write MNT [BIG_MB]            this node's outputs (deterministic bytes)
    _jobtool.py readloop SRC MNT SECONDS      compare file bytes repeatedly for SECONDS
    _jobtool.py rewrite MNT                   rewrite this node's notes in place (version 2)
    _jobtool.py crossread MNT HOSTS VERSION   the other nodes' small outputs, byte for byte
    _jobtool.py kill MNT                      SIGKILL this node's daemon of MNT (a crash)
"""

from __future__ import annotations

import errno
import os
import random
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _harness import assert_same_tree  # noqa: E402

SMALL = (("notes.txt", 1000), ("metrics/epoch-1.json", 20_000), ("metrics/epoch-2.json", 300_000))
REWRITTEN = "notes.txt"  # `rewrite` gives it version 2 (same size, other bytes)


def content(host: str, name: str, size: int, version: int = 1) -> bytes:
    """The bytes node `host` writes as `name` (the test regenerates them to compare); version
    2 of `REWRITTEN` after `rewrite`."""
    key = f"{host}/{name}" if version == 1 or not name.endswith(REWRITTEN) else f"{host}/{name}#2"
    return random.Random(key).randbytes(size)


def outputs(host: str, big_mb: int) -> dict[str, int]:
    """Relative path -> size of everything `host` writes (under out-HOST/)."""
    files = {f"out-{host}/{n}": s for n, s in SMALL}
    if big_mb:
        files[f"out-{host}/checkpoint.pt"] = big_mb << 20
    return files


def write(mnt: str, big_mb: int) -> None:
    host = socket.gethostname()
    for rel, size in outputs(host, big_mb).items():
        path = os.path.join(mnt, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            data = content(host, rel, size)
            for off in range(0, size, 8 << 20):
                f.write(data[off : off + (8 << 20)])
    print(f"{host}: wrote {len(outputs(host, big_mb))} files", flush=True)


def rewrite(mnt: str) -> None:
    """Overwrite this node's `REWRITTEN` in place (no truncation: the other nodes' cached
    pages of version 1 have the same size)."""
    host = socket.gethostname()
    rel = f"out-{host}/{REWRITTEN}"
    with open(os.path.join(mnt, rel), "r+b") as f:
        f.write(content(host, rel, dict(SMALL)[REWRITTEN], 2))
    print(f"{host}: rewrote {rel}", flush=True)


def crossread(mnt: str, hosts: list[str], version: int) -> None:
    """Right after the other nodes closed them (the previous job step), their small outputs
    must read back byte for byte here (close-to-open across nodes)."""
    me = socket.gethostname()
    n = 0
    for host in hosts:
        if host == me:
            continue
        for rel, size in outputs(host, 0).items():
            with open(os.path.join(mnt, rel), "rb") as f:
                got = f.read()
            if got != content(host, rel, size, version):
                raise SystemExit(f"{me}: WRONG BYTES: {rel} (version {version}) from {host}")
            n += 1
    print(f"{me}: read {n} files written on other nodes, version {version}: identical",
          flush=True)


def readloop(src: str, mnt: str, seconds: float) -> None:
    """Compare every file for `seconds` (at least one round). A read that fails with an errno
    is counted and reported; a read that returns other bytes than the source fails at once."""
    host = socket.gethostname()
    files = []
    for d, _, names in os.walk(src):
        for n in names:
            p = os.path.join(d, n)
            if os.path.isfile(p) and not os.path.islink(p):
                files.append(os.path.relpath(p, src))
    deadline = time.monotonic() + seconds
    rounds = same = 0
    errors: dict[str, int] = {}
    while rounds == 0 or time.monotonic() < deadline:
        random.Random(rounds).shuffle(files)
        for rel in files:
            with open(os.path.join(src, rel), "rb") as a:
                want = a.read()
            try:
                with open(os.path.join(mnt, rel), "rb") as b:
                    got = b.read()
            except OSError as e:
                name = errno.errorcode.get(e.errno or 0, str(e.errno))
                errors[name] = errors.get(name, 0) + 1
                continue
            if got != want:
                raise SystemExit(f"{host}: WRONG BYTES: {rel} differs from the source")
            same += 1
        rounds += 1
    print(f"{host}: {same} file reads in {rounds} rounds identical to the source; "
          f"errors: {errors or 'none'}", flush=True)


def kill(mnt: str) -> None:
    """SIGKILL this node's daemon of `mnt` (found by its state file), and wait until it is gone."""
    from fanstore_fuse._mountctl import find_state, pid_alive

    st = find_state(mnt)
    if st is None or not st.pids:
        raise SystemExit(f"{socket.gethostname()}: no daemon of {mnt}")
    os.kill(st.pids[0], 9)
    deadline = time.monotonic() + 30
    while pid_alive(st.pids[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    print(f"{socket.gethostname()}: killed daemon pid {st.pids[0]}", flush=True)


def main(argv: list[str]) -> None:
    if argv[0] == "compare":
        # as the job user: the mount is that user's, and so is its root (MountView.root_owner)
        owner = (os.getuid(), os.getgid()) if os.getuid() != 0 else None
        n = assert_same_tree(argv[1], argv[2], owner)
        print(f"{socket.gethostname()}: {n} entries identical to the source", flush=True)
    elif argv[0] == "write":
        write(argv[1], int(argv[2]) if len(argv) > 2 else 0)
    elif argv[0] == "readloop":
        readloop(argv[1], argv[2], float(argv[3]))
    elif argv[0] == "rewrite":
        rewrite(argv[1])
    elif argv[0] == "crossread":
        crossread(argv[1], argv[2].split(","), int(argv[3]))
    elif argv[0] == "kill":
        kill(argv[1])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
