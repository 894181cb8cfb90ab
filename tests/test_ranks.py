"""Several ranks in one process (tests/_ranks.py): blob failover across replicas and DEST, and
files written on one rank seen on another through Operations. No MPI, no mount."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pyfuse3
import pytest
from _ops import CTX, errno_of, listdir, read_all, resolve
from _ranks import Net, compose_rank

from fanstore_fuse import PrepOptions, prep
from fanstore_fuse._errors import ChecksumError
from fanstore_fuse._format import MANIFEST_NAME
from fanstore_fuse._fuse_ops import Operations
from fanstore_fuse._manifest import read_manifest
from fanstore_fuse._messages import OP_W_DIRTY, OP_W_LIST
from fanstore_fuse._ring import Placement
from fanstore_fuse._shared_writes import REMOTE_INODE_BASE
from fanstore_fuse.writes import WriteStore

N = 3


@pytest.fixture
def cluster(src_tree: Path, tmp_path: Path):
    """(dest, placement, [local dir per rank]): every local dir a full copy of DEST."""
    dest = tmp_path / "dest"
    prep(src_tree, dest, PrepOptions(partitions=N, chunk_size=1 << 20))
    m = read_manifest(dest / MANIFEST_NAME)
    placement = Placement(N, 2, is_broadcast=lambda b: m.partitions[m.blobs["part"][b]].broadcast)
    locals_ = [tmp_path / f"local{r}" for r in range(N)]
    for d in locals_:
        shutil.copytree(dest, d)
    return dest, placement, locals_


def _blob_of(dest: Path, rel: bytes, k: int) -> tuple[int, str, int]:
    """(blob id, partition file name, offset) of chunk k of a file."""
    m = read_manifest(dest / MANIFEST_NAME)
    from fanstore_fuse._namespace import Namespace

    ns = Namespace(m)
    b = ns.record(ns.resolve(rel)).first + k
    return b, m.partitions[m.blobs["part"][b]].name, int(m.blobs["offset"][b])


def _flip(path: Path, off: int) -> None:
    with open(path, "r+b") as f:
        f.seek(off)
        c = f.read(1)
        f.seek(off)
        f.write(bytes([c[0] ^ 0xFF]))


def _order(placement: Placement, blob: int, reader: int) -> list[int]:
    """The holders `reader` asks, in order (as ClusterBlobSource spreads them)."""
    others = [h for h in placement.locate_data(blob) if h != reader]
    k = (blob + reader) % len(others)
    return others[k:] + others[:k]


def _reader_of(placement: Placement, blob: int) -> int:
    return next(r for r in range(N) if not placement.holds(r, blob))


async def test_a_bad_replica_is_skipped_for_the_next(cluster, src_tree, error_log):
    dest, placement, locals_ = cluster
    blob, part, off = _blob_of(dest, b"big.bin", 1)
    reader = _reader_of(placement, blob)
    first, second = _order(placement, blob, reader)
    _flip(locals_[first] / part, off + 10)
    error_log.expect(rf"blob {blob} from rank {first}: .*trying the next copy")
    net = Net(N)
    ranks = [compose_rank(net, r, dest, locals_[r], placement) for r in range(N)]
    node = ranks[reader].node
    index = node.ns.resolve(b"big.bin")
    want = (src_tree / "big.bin").read_bytes()
    assert await node.read(index, 0, len(want)) == want
    assert node.stats.remote_reads >= 1 and node.stats.errors == 1
    for p in ranks:
        p.close()


async def test_silent_and_bad_holders_fall_back_to_dest(cluster, src_tree, error_log):
    dest, placement, locals_ = cluster
    blob, part, off = _blob_of(dest, b"big.bin", 0)
    reader = _reader_of(placement, blob)
    first, second = _order(placement, blob, reader)
    _flip(locals_[second] / part, off + 10)
    error_log.expect(rf"blob {blob}: rank {first} did not answer")
    error_log.expect(rf"blob {blob} from rank {second}: ")
    net = Net(N)
    net.silent.add(first)
    ranks = [compose_rank(net, r, dest, locals_[r], placement, timeout=0.2) for r in range(N)]
    source = ranks[reader].node.source
    want = (src_tree / "big.bin").read_bytes()[: 1 << 20]
    assert await source.fetch(blob) == want
    assert ranks[reader].node.stats.extra["source_reads"] == 1
    # The silent rank is now a suspect: with DEST to fall back on, it is not asked again.
    # (Damage the data, not the frame table: a verified table is kept, docs/format.md.)
    _flip(dest / part, off + 100_000)
    with pytest.raises(ChecksumError):
        await source.fetch(blob)
    for p in ranks:
        p.close()


@pytest.fixture
def two_ranks(cluster, tmp_path):
    dest, _, locals_ = cluster
    placement = Placement(2, 1)
    net = Net(2)
    stores = [WriteStore(str(locals_[r]), r) for r in range(2)]
    parts = [compose_rank(net, r, dest, locals_[r], placement, stores[r]) for r in range(2)]
    yield [Operations(p.view) for p in parts], net
    for s in stores:
        s.close_store()
    for p in parts:
        p.close()


async def test_a_file_closed_on_one_rank_is_read_on_the_other(two_ranks, replies):
    (ops0, ops1), _ = two_ranks
    data = os.urandom((5 << 20) + 333)  # two 4 MiB chunks, each verified by the reader
    d0 = await resolve(ops0, b"classes")
    info, _ = await ops0.create(d0, b"ckpt.bin", 0o100640, os.O_WRONLY | os.O_CREAT, CTX)
    for off in range(0, len(data), 1 << 20):
        await ops0.write(info.fh, off, data[off : off + (1 << 20)])
    await ops0.flush(info.fh)  # close(2): committed and published before it returns
    await ops0.release(info.fh)

    d1 = await resolve(ops1, b"classes")
    a = await ops1.lookup(d1, b"ckpt.bin", CTX)
    assert a.st_ino >= REMOTE_INODE_BASE and a.st_size == len(data) and a.attr_timeout == 0
    assert a.st_mode == 0o100640
    assert await read_all(ops1, a.st_ino) == data
    assert (await listdir(ops1, d1, replies))[-1] == b"ckpt.bin"
    assert await errno_of(ops1.open(a.st_ino, os.O_WRONLY, CTX)) == errno.EPERM
    assert await errno_of(ops1.unlink(d1, b"ckpt.bin", CTX)) == errno.EPERM
    assert await errno_of(ops1.create(d1, b"ckpt.bin", 0o100644, os.O_WRONLY, CTX)) == errno.EEXIST

    await ops0.rename(d0, b"ckpt.bin", d0, b"final.bin", 0, CTX)
    assert await errno_of(ops1.lookup(d1, b"ckpt.bin", CTX)) == errno.ENOENT
    assert (await ops1.lookup(d1, b"final.bin", CTX)).st_size == len(data)
    await ops0.unlink(d0, b"final.bin", CTX)
    assert await errno_of(ops1.lookup(d1, b"final.bin", CTX)) == errno.ENOENT
    assert b"final.bin" not in await listdir(ops1, d1, replies)


async def test_a_silent_owner_does_not_break_listing_the_dataset(two_ranks, replies):
    (ops0, ops1), net = two_ranks
    root = pyfuse3.ROOT_INODE
    whole = await listdir(ops1, root, replies)
    owner = Placement(2, 1).locate_metadata(b"")
    if owner == 1:
        ops0, ops1 = ops1, ops0
        whole = await listdir(ops1, root, replies)
    net.silent.add(owner)
    assert await listdir(ops1, root, replies) == whole


@pytest.fixture
def three_writable(cluster):
    """Three ranks with written files, and every request they send, as (from, to, op)."""
    dest, _, locals_ = cluster
    placement = Placement(N, 1)
    net = Net(N)
    stores = [WriteStore(str(locals_[r]), r) for r in range(N)]
    parts = [compose_rank(net, r, dest, locals_[r], placement, stores[r]) for r in range(N)]
    sent: list[tuple[int, int, int]] = []
    for p in parts:
        link, send = p.transport, p.transport.request

        async def logged(dest_, frame, timeout, link=link, send=send):
            sent.append((link.rank, dest_, frame.op))
            return await send(dest_, frame, timeout)

        link.request = logged
    yield [Operations(p.view) for p in parts], placement, net, sent
    for s in stores:
        s.close_store()
    for p in parts:
        p.close()


async def test_a_dataset_directory_is_listed_without_asking_until_someone_writes_in_it(
        three_writable, replies):
    ops, placement, net, sent = three_writable
    owner = placement.locate_metadata(b"classes")
    reader, writer = (owner + 1) % N, (owner + 2) % N
    d = [await resolve(o, b"classes") for o in ops]
    names = await listdir(ops[reader], d[reader], replies)
    assert (reader, owner, OP_W_LIST) not in sent  # nobody wrote there: nothing to ask
    # The first create in it is announced to every other rank before it returns...
    info, _ = await ops[writer].create(d[writer], b"new.bin", 0o100644, os.O_WRONLY | os.O_CREAT, CTX)
    assert {(owner, r, OP_W_DIRTY) for r in range(N) if r != owner} <= set(sent)
    # ...so every rank lists the new entry at once, asking the owner from then on.
    for r in range(N):
        assert await listdir(ops[r], d[r], replies) == [*names, b"new.bin"]
    assert (reader, owner, OP_W_LIST) in sent
    await ops[writer].release(info.fh)
    # A second entry is not announced again; a rank that does not answer is skipped.
    announced = sent.count((owner, reader, OP_W_DIRTY))
    info, _ = await ops[writer].create(d[writer], b"two.bin", 0o100644, os.O_WRONLY | os.O_CREAT, CTX)
    await ops[writer].release(info.fh)
    assert sent.count((owner, reader, OP_W_DIRTY)) == announced
    # A rank that does not answer the announcement is skipped (and not asked again).
    net.silent.add(reader)
    told = [x for x in sent if x[1] == reader and x[2] == OP_W_DIRTY]
    candidates = [b"a", b"a/b", b"a/b/c", b"empty dir", *(b"classes/class_%d" % k for k in range(3))]
    by_owner: dict[int, list[bytes]] = {}
    for p in candidates:
        by_owner.setdefault(placement.locate_metadata(p), []).append(p)
    o, two = next((o, ps[:2]) for o, ps in by_owner.items() if o != reader and len(ps) >= 2)
    for p in two:
        parent = await resolve(ops[o], p)
        info, _ = await ops[o].create(parent, b"late.bin", 0o100644, os.O_WRONLY | os.O_CREAT, CTX)
        await ops[o].release(info.fh)
        assert b"late.bin" in await listdir(ops[o], parent, replies)
    tries = [x for x in sent if x[1] == reader and x[2] == OP_W_DIRTY]
    assert len(tries) == len(told) + 1, tries  # the first announcement timed out, not the second
