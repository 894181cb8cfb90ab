"""Job-script mode on a real 3-node Slurm cluster: scripts/slurm/job.sbatch as shipped, with
`fanstore-fuse mount` inside the job (srun --mpi=pmi2 for MPICH, pmix for Open MPI), a
byte-for-byte check on every node, `status`, one umount that ends every node, and nothing left
behind on any node."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _harness import build_tree, prep_cli
from _slurm import REPO, job_env

from fanstore_fuse import _mpilib
from fanstore_fuse._node import BlobCache

pytestmark = [pytest.mark.slurm, pytest.mark.mount, pytest.mark.mpi]

JOB = REPO / "scripts" / "slurm" / "job.sbatch"
CHECK = Path(__file__).resolve().parent / "_check_tree.py"
EPOCHS = Path(__file__).resolve().parent / "_two_epochs.py"
FOUR = Path(__file__).resolve().parent / "_four_readers.py"


def _dataset(shared_dir: Path) -> tuple[Path, Path]:
    src = build_tree(shared_dir / "src")
    dest = prep_cli(src, shared_dir / "dest", "--chunk-mib", "1", "-p", "3")
    return src, dest


def _nothing_left(c, job: int) -> None:
    """No FUSE mount, no fanstore process, no local copy or mount state on any node."""
    for k in range(c.nodes):
        assert c.fuse_mounts(k) == [], f"n{k}: FUSE mounts left"
        for needle in ("fanstore_fuse", "fanstore-fuse"):
            assert c.procs(k, needle) == [], f"n{k}: fanstore processes left"
        left = [e for e in c.local_entries(k) if e != "fanstore-fuse-0"]
        assert left == [], f"n{k}: left in /tmp after job {job}: {left}"
        state = c.node_tmp(k) / "fanstore-fuse-0"
        stale = [p.name for p in state.iterdir() if not p.name.endswith(".log")] \
            if state.exists() else []
        assert stale == [], f"n{k}: mount state left: {stale}"


def _train_on_every_node(c, shared_dir: Path, script: Path, export: str, marker: str):
    """job.sbatch with `script SRC` as the training step on every node; the job and the one
    line per node that holds `marker`, in node order (asserted: one from each node)."""
    src, dest = _dataset(shared_dir)
    train = f"{sys.executable} {script} {src}"
    res = c.submit(JOB, f"--nodes={c.nodes}", f"--chdir={shared_dir}",
                   f"--export=ALL,DATASET={dest},TRAIN={train}{export}",
                   env=job_env(c), timeout=240)
    print(res)
    assert (res.state, res.exit_code) == ("COMPLETED", 0), str(res)
    lines = sorted(ln for ln in res.output.splitlines() if marker in ln)
    assert [ln.split(":")[0] for ln in lines] == [f"n{k}" for k in range(c.nodes)], res.output
    return res, lines


@pytest.mark.timeout(300)
def test_job_script_mounts_on_every_node_and_leaves_nothing(slurm_cluster, shared_dir):
    c = slurm_cluster
    src, dest = _dataset(shared_dir)
    train = f"{sys.executable} {CHECK} {src}"
    res = c.submit(JOB, f"--nodes={c.nodes}", f"--chdir={shared_dir}",
                   f"--export=ALL,DATASET={dest},TRAIN={train}", env=job_env(c), timeout=240)
    print(res)
    assert (res.state, res.exit_code) == ("COMPLETED", 0), str(res)
    assert f"mounted {dest} on {c.nodes} rank(s)" in res.output
    for k in range(c.nodes):
        assert f"n{k}: " in res.output and "entries identical to the source" in res.output
    identical = [ln for ln in res.output.splitlines() if "entries identical" in ln]
    assert sorted(ln.split(":")[0] for ln in identical) == [f"n{k}" for k in range(c.nodes)]
    status = json.loads((shared_dir / f"fanstore-status-{res.job_id}.json").read_text())
    assert sorted(r["rank"] for r in status["ranks"]) == list(range(c.nodes))
    # one umount from the batch script ended every node's daemon
    assert res.output.count("unmounted: /tmp/fanstore-") == 1
    assert all(f"rank {k} on n{k}: unmounting" in res.output for k in range(1, c.nodes)), res.output
    _nothing_left(c, res.job_id)


@pytest.mark.timeout(300)
def test_second_epoch_reads_remote_blobs_from_each_nodes_disk_cache(slurm_cluster, shared_dir):
    """Two epochs on every node with a 1-byte in-memory blob cache (every read reaches the blob
    source): the second fetches nothing from other nodes, the disk cache answers, the bytes are
    the source's, and the cache goes with the job."""
    c = slurm_cluster
    res, lines = _train_on_every_node(c, shared_dir, EPOCHS, ",FANSTORE_CACHE_BYTES=1", ": epoch 2: ")
    for ln in lines:
        fetched = int(ln.split("fetched from other nodes ")[1].split(";")[0])
        hits = int(ln.split("disk cache hits ")[1].split(";")[0])
        mem = int(ln.split("blob cache hits ")[1].split(";")[0])
        cached = int(ln.split("cached blobs ")[1])
        # every cached blob read locally: from the disk cache, or the few large blobs the
        # in-memory blob cache still kept from epoch 1 (its BIG_SLOTS)
        assert fetched == 0 and cached > 0 and hits + min(mem, BlobCache.BIG_SLOTS) >= cached, ln
    # epoch 1 read other nodes' blobs over this cluster's network
    firsts = sorted(ln for ln in res.output.splitlines() if ": epoch 1: remote reads" in ln)
    assert len(firsts) == c.nodes and all(ln.endswith("errors 0") for ln in firsts), res.output
    for key, end in (("remote reads ", ","), ("requests served ", ","), ("MPI bytes received ", ";")):
        assert sum(int(ln.split(key)[1].split(end)[0]) for ln in firsts) > 0, (key, firsts)
    _nothing_left(c, res.job_id)


@pytest.mark.timeout(300)
def test_four_readers_per_node_read_every_byte_across_nodes(slurm_cluster, shared_dir):
    """4 reader threads on every node, each reading the whole tree in its own order, byte for
    byte, with overlapping READs of the same files, remote ones included: no error on any node,
    and blobs of other nodes were read."""
    c = slurm_cluster
    res, lines = _train_on_every_node(c, shared_dir, FOUR, "", ": 4 readers: ")
    for ln in lines:
        assert "errors 0 " in ln and "daemon errors 0;" in ln, ln
    assert sum(int(ln.split("remote reads ")[1]) for ln in lines) > 0, lines
    _nothing_left(c, res.job_id)


@pytest.mark.timeout(180)
def test_ranks_that_do_not_meet_fail_with_one_clear_line(slurm_cluster, shared_dir):
    """srun --mpi=none: every task would be a world of one. `mount` must say so before MPI_Init,
    naming the plugin the library needs, and mount nothing, not start three one-rank file
    systems."""
    c = slurm_cluster
    _, dest = _dataset(shared_dir)
    res = c.submit(JOB, f"--nodes={c.nodes}", f"--chdir={shared_dir}",
                   f"--export=ALL,DATASET={dest},TRAIN=true", env=job_env(c, FANSTORE_SRUN_MPI="none"),
                   timeout=150)
    print(res)
    assert res.state == "FAILED", str(res)
    errors = [ln for ln in res.output.splitlines() if ln.startswith("fanstore-fuse: ")]
    assert len(errors) == 1, res.output
    lib = _mpilib.library()
    assert f"{lib.name} needs PMI" in errors[0] and f"to start {c.nodes} ranks together" in errors[0]
    assert f"FANSTORE_SRUN_MPI={_mpilib.srun_preferences(lib)[0]}" in errors[0], errors
    assert "mounted" not in res.output.replace("unmounted", "")
    _nothing_left(c, res.job_id)
