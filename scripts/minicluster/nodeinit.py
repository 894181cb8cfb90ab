"""pid 1 of a test node (fresh UTS, mount and PID namespaces):

    nodeinit.py NAME TMPDIR CMD...

sets the hostname to NAME, detaches the FUSE mounts copied from the host, binds TMPDIR on /tmp
(what the checkout and this interpreter have under the host's /tmp is bound back into it), opens
the node to job users other than root as a compute node is (jobuser.py: /dev/fuse 0666,
this interpreter reachable; the originals kept in TMPDIR/../open), then runs CMD (slurmd), reaps
every orphan (slurmstepd and the tasks it leaves), passes SIGTERM/SIGINT/SIGHUP on, and exits
with CMD's status."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import jobuser


def drop_inherited_fuse_mounts() -> None:
    """The new mount namespace copied the host's FUSE mounts (other users' live mounts): detach
    the copies here, so that a node starts with none and holds no one else's mount open."""
    with open("/proc/self/mounts") as f:
        points = [ln.split()[1] for ln in f if ln.split()[2].startswith("fuse.")
                  or ln.split()[2] == "fuse"]
    for p in reversed(points):
        raw = p.encode().decode("unicode_escape").encode("latin-1")  # undo \\040 and friends
        subprocess.run([b"umount", b"-l", raw], stderr=subprocess.DEVNULL, check=False)


def mount(*args: str) -> None:
    r = subprocess.run(["mount", *args], capture_output=True, text=True)
    if r.returncode != 0:
        why = " ".join(r.stderr.split()) or f"exit status {r.returncode}"
        raise OSError(f"mount {' '.join(args)}: {why}")


def private_tmp(tmpdir: str, keep: Path, needed: list[str]) -> None:
    """Bind `tmpdir` on /tmp, keeping what `needed` (the checkout, the interpreter) has under
    the host's /tmp: each such entry of /tmp is bound aside first, then back at its place."""
    tops = jobuser.tmp_tops(needed)
    for top in tops:
        (keep / "tmp" / top).mkdir(parents=True, exist_ok=True)
        mount("--rbind", f"/tmp/{top}", str(keep / "tmp" / top))
    mount("--bind", tmpdir, "/tmp")
    for top in tops:
        Path("/tmp", top).mkdir(exist_ok=True)
        mount("--rbind", str(keep / "tmp" / top), f"/tmp/{top}")


name, tmpdir, cmd = sys.argv[1], sys.argv[2], sys.argv[3:]
try:
    socket.sethostname(name)
    drop_inherited_fuse_mounts()
    keep = Path(tmpdir).resolve().parent / "open"
    keep.mkdir(exist_ok=True)
    needed = jobuser.interpreter_paths(str(Path(__file__).resolve().parents[2]))
    private_tmp(tmpdir, keep, needed)
    jobuser.open_fuse(keep)
    jobuser.open_dirs(keep, needed)
except (OSError, subprocess.CalledProcessError) as e:
    print(f"node {name} cannot start: {e}", file=sys.stderr, flush=True)
    sys.exit(1)
child = os.fork()
if child == 0:
    os.execvp(cmd[0], cmd)
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, lambda s, _f: os.kill(child, s))
while True:
    try:
        pid, status = os.wait()
    except ChildProcessError:
        sys.exit(0)
    except InterruptedError:
        continue
    if pid == child:
        sys.exit(os.waitstatus_to_exitcode(status) & 0xFF)
