"""Hard links, symlinks, user.* attributes and a growing log, written on one node of the 3-node
test cluster and read on the others: a job that mounts on every node (`fanstore-fuse mount`
in the batch script), every node links its own files and checks the other two nodes' links
after close (close-to-open: the same bytes through every name, symlinks, user.* attributes),
then after one name of a linked file is unlinked on its writer;
n0 appends checksummed records while n1 and n2 poll the log. The one `umount --stage-out` at
the end must reproduce each hard link as one inode, the symlinks and the attributes."""

from __future__ import annotations

import os
import re
from pathlib import Path

import _jobtool
import pytest
from _harness import build_tree, prep_cli
from _slurm import job_env
from test_lifecycle import NODES, TOOL, _log, _no_mount_anywhere, _script

pytestmark = [pytest.mark.slurm, pytest.mark.mount, pytest.mark.mpi]

APPEND_SECONDS = 6
PHASE = re.compile(r"^(n\d): phase (\d): (n\d)'s links: bytes identical through every name; "
                   r"nlink (\d+) (\d+); same inode (True|False); survivor nlink (\d+); "
                   r"symlinks ok; xattr (\S+); listed (True|False)$")


def _staged_links(out: Path, host: str) -> None:
    """What stage-out made of `host`'s links: one inode for both names of the file still
    linked, the survivor of the unlinked name alone, the symlinks, the attribute."""
    d = out / _jobtool.links_dir(host)
    orig, hard = d / "orig.bin", d / _jobtool.LINKED["orig.bin"]
    assert orig.read_bytes() == hard.read_bytes() == _jobtool.link_content(host, "orig.bin")
    a, b = orig.lstat(), hard.lstat()
    assert a.st_ino == b.st_ino and a.st_nlink == 2, (host, a, b)
    survivor = d / _jobtool.LINKED[_jobtool.UNLINKED]
    assert survivor.read_bytes() == _jobtool.link_content(host, _jobtool.UNLINKED)
    assert survivor.lstat().st_nlink == 1 and not (d / _jobtool.UNLINKED).exists()
    for name, target in _jobtool.SYMLINKS.items():
        assert os.readlink(d / name) == target, (host, name)
    assert os.getxattr(orig, _jobtool.XATTR) == host.encode()


@pytest.mark.timeout(420)
def test_links_symlinks_xattrs_and_an_appended_log_across_nodes(slurm_cluster, shared_dir, jobs):
    c = slurm_cluster
    dest = prep_cli(build_tree(shared_dir / "src"), shared_dir / "dest", "--chunk-mib", "1",
                    "-p", "3")
    out = shared_dir / "out"
    hosts = ",".join(NODES)
    script = _script(shared_dir / "job.sh", dest, f"""
trap 'rc=$?; fanstore-fuse umount "$MNT" --stage-out {out} || rc=1; echo "umount: exit $rc"; exit $rc' EXIT
srun --overlap --ntasks-per-node=1 python {TOOL} link "$MNT"
srun --overlap --ntasks-per-node=1 python {TOOL} checklinks "$MNT" {hosts} 1
srun --overlap --ntasks-per-node=1 python {TOOL} unlinkone "$MNT"
srun --overlap --ntasks-per-node=1 python {TOOL} checklinks "$MNT" {hosts} 2
srun --overlap -N1 -n1 -w n0 python {TOOL} append "$MNT" {APPEND_SECONDS} &
writer=$!
srun --overlap -N2 -n2 -w n1,n2 python {TOOL} follow "$MNT" n0 120
wait $writer
""")
    res = c.submit(script, env=job_env(c), timeout=330)
    print(res)
    assert (res.state, res.exit_code) == ("COMPLETED", 0), str(res)
    assert "umount: exit 0" in res.output
    lines = res.output.splitlines()
    assert sum(ln.endswith(": linked 2 files, 2 symlinks, 1 xattr") for ln in lines) == 3, res.output

    # Every node read both other nodes' links, through every name, after close.
    seen = [m.groups() for m in map(PHASE.match, lines) if m]
    assert sorted((r, p, h) for r, p, h, *_ in seen) == sorted(
        (r, p, h) for r in NODES for p in "12" for h in NODES if h != r), res.output
    for reader, phase, host, n1, n2, same, survivor, xattr, listed in seen:
        what = f"{reader} reading {host}'s links (phase {phase})"
        # On a node other than the writer each name is its own inode, st_nlink 1 (semantics.md,
        # "Hard links across nodes"); on the writer (`link` checks) and staged out, one inode.
        assert (n1, n2, same, survivor) == ("1", "1", "False", "1"), what
        assert (xattr, listed) == (host, "True"), what

    # The log appended on n0, polled on n1 and n2: a prefix that grew, never an error.
    (appended,) = [int(ln.split()[2]) for ln in lines if ln.startswith("n0: appended ")]
    follows = [ln for ln in lines if ": followed applog-n0.log: " in ln]
    assert sorted(ln.split(":")[0] for ln in follows) == ["n1", "n2"], res.output
    for ln in follows:
        assert ln.endswith("errors 0"), ln
        assert int(ln.split(" grew ")[1].split()[0]) >= 3, ln
        assert f" {appended} records, tail read {appended};" in ln, (ln, appended)

    # The one umount's stage-out: hard links as hard links, symlinks, attributes, the log.
    for host in NODES:
        _staged_links(out, host)
    assert (out / _jobtool.log_name("n0")).read_bytes() == _jobtool.log_content("n0", appended)
    print(f"{appended} records appended on n0 and followed on n1, n2; staged out from 3 nodes")
    _no_mount_anywhere(c, res.job_id)
    log = _log(jobs, res.job_id)
    assert "kept" not in log and "stale" not in log, log  # the epilog found nothing to do
