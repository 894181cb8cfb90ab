"""Run inside a job on a node (and imported by the tests): compare the mount with the source,
write this node's outputs, read while a peer dies.

    _jobtool.py compare SRC MNT               every entry and byte of MNT equals SRC
    _jobtool.py write MNT [BIG_MB]            this node's outputs (deterministic bytes)
    _jobtool.py readloop SRC MNT SECONDS      compare file bytes repeatedly for SECONDS
    _jobtool.py rewrite MNT                   rewrite this node's notes in place (version 2)
    _jobtool.py crossread MNT HOSTS VERSION   the other nodes' small outputs, byte for byte
    _jobtool.py kill MNT                      SIGKILL this node's daemon of MNT (a crash)
    _jobtool.py link MNT                      this node's hard links, symlinks and xattrs
    _jobtool.py checklinks MNT HOSTS PHASE    the other nodes' links (PHASE 2: after unlinkone)
    _jobtool.py unlinkone MNT                 unlink one name of a linked file (the other stays)
    _jobtool.py append MNT SECONDS            append checksummed records to this node's log
    _jobtool.py follow MNT HOST SECONDS       poll HOST's log until its last record: 0 errors
"""

from __future__ import annotations

import errno
import os
import random
import socket
import sys
import time
import zlib

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


# ------------------------------------------------------------------ hard links, symlinks, xattrs

LINKED = {"orig.bin": "sub/hard.bin", "temp.bin": "sub/survivor.bin"}  # name -> its second name
UNLINKED = "temp.bin"  # `unlinkone` removes this name; its second name stays
SYMLINKS = {"sub/rel-link": "../orig.bin", "dangling": "/nowhere/at/all"}
XATTR = "user.origin"


def links_dir(host: str) -> str:
    return f"links-{host}"


def link_content(host: str, name: str) -> bytes:
    return content(host, f"{links_dir(host)}/{name}", 300_000 if name == "orig.bin" else 5_000)


def link(mnt: str) -> None:
    """Files written here, each given a second name in another directory (link(2)), symlinks,
    and a user.* attribute on one file."""
    host = socket.gethostname()
    d = os.path.join(mnt, links_dir(host))
    os.makedirs(os.path.join(d, "sub"))
    for name, other in LINKED.items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(link_content(host, name))
        os.link(os.path.join(d, name), os.path.join(d, other))
    for name, target in SYMLINKS.items():
        os.symlink(target, os.path.join(d, name))
    os.setxattr(os.path.join(d, "orig.bin"), XATTR, host.encode())
    a, b = (os.stat(os.path.join(d, n)) for n in ("orig.bin", LINKED["orig.bin"]))
    if (a.st_ino, a.st_nlink) != (b.st_ino, 2) or b.st_nlink != 2:
        raise SystemExit(f"{host}: link on the writing node: inodes {a.st_ino}/{b.st_ino}, "
                         f"nlink {a.st_nlink}/{b.st_nlink}")
    print(f"{host}: linked {len(LINKED)} files, {len(SYMLINKS)} symlinks, 1 xattr", flush=True)


def _errname(e: OSError) -> str:
    return errno.errorcode.get(e.errno or 0, str(e.errno))


def checklinks(mnt: str, hosts: list[str], phase: int) -> None:
    """The other nodes' links as this node sees them, right after they were made (phase 1) or
    after `unlinkone` (phase 2). Wrong bytes or a failing call end it; nlink, inodes and the
    attribute are printed (one line per host) for the test to check."""
    me = socket.gethostname()
    for host in hosts:
        if host == me:
            continue
        d = os.path.join(mnt, links_dir(host))
        for name, other in LINKED.items():
            names = [other] if phase == 2 and name == UNLINKED else [name, other]
            for n in names:
                with open(os.path.join(d, n), "rb") as f:
                    if f.read() != link_content(host, name):
                        raise SystemExit(f"{me}: WRONG BYTES: {host}'s {n} (phase {phase})")
        if phase == 2 and os.path.lexists(os.path.join(d, UNLINKED)):
            raise SystemExit(f"{me}: {host}'s {UNLINKED} still there after its unlink")
        for name, target in SYMLINKS.items():
            got = os.readlink(os.path.join(d, name))
            if got != target:
                raise SystemExit(f"{me}: {host}'s symlink {name} reads {got!r}")
        with open(os.path.join(d, "sub/rel-link"), "rb") as f:  # followed
            if f.read() != link_content(host, "orig.bin"):
                raise SystemExit(f"{me}: WRONG BYTES through {host}'s symlink")
        a, b = (os.stat(os.path.join(d, n)) for n in ("orig.bin", LINKED["orig.bin"]))
        s = os.stat(os.path.join(d, LINKED[UNLINKED]))
        try:
            x = os.getxattr(os.path.join(d, "orig.bin"), XATTR).decode()
        except OSError as e:
            x = _errname(e)
        listed = XATTR in os.listxattr(os.path.join(d, "orig.bin"))
        print(f"{me}: phase {phase}: {host}'s links: bytes identical through every name; "
              f"nlink {a.st_nlink} {b.st_nlink}; same inode {a.st_ino == b.st_ino}; "
              f"survivor nlink {s.st_nlink}; symlinks ok; xattr {x}; listed {listed}", flush=True)


def unlinkone(mnt: str) -> None:
    host = socket.gethostname()
    d = os.path.join(mnt, links_dir(host))
    os.unlink(os.path.join(d, UNLINKED))
    st = os.stat(os.path.join(d, LINKED[UNLINKED]))
    with open(os.path.join(d, LINKED[UNLINKED]), "rb") as f:
        if f.read() != link_content(host, UNLINKED) or st.st_nlink != 1:
            raise SystemExit(f"{host}: {LINKED[UNLINKED]} after unlinking {UNLINKED}: nlink "
                             f"{st.st_nlink} or bytes wrong")
    print(f"{host}: unlinked {UNLINKED}, {LINKED[UNLINKED]} kept", flush=True)


# ------------------------------------------------------------------ a log appended on one node

RECORD = 64  # bytes of one record (a line)


def log_name(host: str) -> str:
    return f"applog-{host}.log"


def record(host: str, seq: int, last: bool = False) -> bytes:
    """Record `seq` of `host`'s log: sequence number, payload, end mark, crc32 of the rest."""
    payload = random.Random(f"{host}/{seq}").randbytes(14).hex()
    body = f"{seq:010d} {host:>8} {payload} {'E' if last else '-'} ".encode()
    line = body + f"{zlib.crc32(body):08x}".encode()
    return line + b"." * (RECORD - 1 - len(line)) + b"\n"


def log_content(host: str, n: int) -> bytes:
    return b"".join(record(host, i, i == n - 1) for i in range(n))


def append(mnt: str, seconds: float) -> None:
    """Append one record at a time for `seconds`, each in its own open/write/close (every 10th
    fsync'd before its close), the last one marked as the end."""
    host = socket.gethostname()
    path = os.path.join(mnt, log_name(host))
    deadline = time.monotonic() + seconds
    n = 0
    while True:
        last = time.monotonic() >= deadline
        with open(path, "ab") as f:
            f.write(record(host, n, last))
            if n % 10 == 9:
                f.flush()
                os.fsync(f.fileno())
        n += 1
        if last:
            break
        time.sleep(0.01)
    print(f"{host}: appended {n} records of {RECORD} bytes to {log_name(host)}", flush=True)


def _check_records(data: bytes, host: str) -> tuple[int, bool]:
    """(complete records, whether the last one is the end); SystemExit at a wrong record."""
    n = len(data) // RECORD
    end = False
    for i in range(n):
        rec = data[i * RECORD : (i + 1) * RECORD]
        end = i == n - 1 and rec == record(host, i, True)  # only the last may be the end
        if rec != record(host, i, end):
            raise SystemExit(f"{socket.gethostname()}: WRONG BYTES: record {i} of "
                             f"{log_name(host)}: {rec!r}")
    return n, end


def follow(mnt: str, host: str, seconds: float) -> None:
    """Poll `host`'s log (open, read all, close) and read it through one handle kept open (as
    tail -f) until its end record: every complete record right, each poll a prefix at least as
    long as the last. Errors (an errno, a shorter file) are counted and reported; wrong bytes
    end it at once."""
    me = socket.gethostname()
    path = os.path.join(mnt, log_name(host))
    deadline = time.monotonic() + seconds
    polls = grew = records = 0
    errors: dict[str, int] = {}
    tail: bytes = b""
    handle = None
    done = False
    while not done and time.monotonic() < deadline:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            if records:  # it was there before
                errors["ENOENT"] = errors.get("ENOENT", 0) + 1
            time.sleep(0.05)
            continue
        except OSError as e:
            errors[_errname(e)] = errors.get(_errname(e), 0) + 1
            continue
        polls += 1
        n, done = _check_records(data, host)
        if n < records:
            errors["shrank"] = errors.get("shrank", 0) + 1
        grew += n > records
        records = max(records, n)
        try:
            if handle is None:
                handle = open(path, "rb")  # noqa: SIM115 (kept open across polls)
            tail += handle.read()
            _check_records(tail, host)
        except OSError as e:
            errors[f"tail {_errname(e)}"] = errors.get(f"tail {_errname(e)}", 0) + 1
        time.sleep(0.02)
    if handle is not None:
        tail += handle.read()
        handle.close()
    t, tail_done = _check_records(tail, host)
    if not done:
        errors["no end record"] = 1
    elif not tail_done:
        errors["tail short"] = 1
    print(f"{me}: followed {log_name(host)}: {polls} polls, grew {grew} times, {records} records, "
          f"tail read {t}; errors {sum(errors.values())} {errors or ''}".rstrip(), flush=True)


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
    elif argv[0] == "link":
        link(argv[1])
    elif argv[0] == "checklinks":
        checklinks(argv[1], argv[2].split(","), int(argv[3]))
    elif argv[0] == "unlinkone":
        unlinkone(argv[1])
    elif argv[0] == "append":
        append(argv[1], float(argv[2]))
    elif argv[0] == "follow":
        follow(argv[1], argv[2], float(argv[3]))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
