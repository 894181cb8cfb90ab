"""FUSE requests read by the shim's C threads (`_shim_threads.c`, FANSTORE_FUSE_THREADS) on real
default (writable) mounts: dataset files read byte for byte by 4 concurrent readers while a
writer creates, closes, re-reads, renames and removes files on the same mount; every request
processed exactly once (libfuse's debug log), the dataset's answered on the threads, the
written files' through Python; the threads stop with the mount (a clean unmount, also after an
external `fusermount3 -u`); FANSTORE_FUSE_THREADS=0 keeps pyfuse3's own loop."""

from __future__ import annotations

import collections
import contextlib
import os
import random
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest
from _harness import mounted, prep_cli, status_ranks
from _pagecache import drop_page_cache

pytestmark = [pytest.mark.mount]

# tests counting OPEN/RELEASE requests answer them (FANSTORE_NO_OPEN=0; default: none sent)
OPENED = {"FANSTORE_NO_OPEN": "0"}


def _tree(src: Path) -> dict[str, bytes]:
    rng = random.Random(11)
    files = {f"d{i % 5}/f{i:03d}": rng.randbytes(rng.choice([0, 1, 4095, 20_000, 70_000, 140_000]))
             for i in range(120)}
    for rel, body in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(body)
    return files


def _shim(m) -> dict[str, int]:
    return status_ranks(m.status())[0]["fuse_shim"]


def _readers(root: Path, files: dict[str, bytes], n: int, passes: int, errors: list) -> list:
    def run(k: int) -> None:
        rng = random.Random(k)
        names = sorted(files)
        try:
            for _ in range(passes):
                rng.shuffle(names)
                for rel in names:
                    with open(root / rel, "rb", buffering=0) as f:
                        got = f.read()
                    if got != files[rel]:
                        errors.append(f"reader {k}: {rel} differs")
                    os.stat(root / rel)
        except OSError as e:
            errors.append(f"reader {k}: {e!r}")
    return [threading.Thread(target=run, args=(k,), name=f"reader{k}") for k in range(n)]


def _writer(root: Path, files: dict[str, bytes], rounds: int, errors: list) -> threading.Thread:
    def run() -> None:
        rng = random.Random(99)
        out = root / "written"
        try:
            out.mkdir()
            for i in range(rounds):
                body = rng.randbytes(rng.choice([0, 10, 5000, 200_000]))
                p = out / f"w{i:03d}"
                with open(p, "wb") as f:
                    f.write(body)
                if p.read_bytes() != body:
                    errors.append(f"writer: {p.name} differs after close")
                if i % 3 == 0:
                    os.rename(p, out / f"r{i:03d}")
                    if (out / f"r{i:03d}").read_bytes() != body:
                        errors.append(f"writer: r{i:03d} differs after rename")
                elif i % 3 == 1:
                    os.unlink(p)
                    if p.exists():
                        errors.append(f"writer: {p.name} still there after unlink")
                rel = rng.choice(sorted(files))  # dataset reads from the writer too
                if (root / rel).read_bytes() != files[rel]:
                    errors.append(f"writer: dataset {rel} differs")
            names = sorted(os.listdir(out))
            want = sorted([f"r{i:03d}" for i in range(rounds) if i % 3 == 0]
                          + [f"w{i:03d}" for i in range(rounds) if i % 3 == 2])
            if names != want:
                errors.append(f"writer: listing {names} != {want}")
        except OSError as e:
            errors.append(f"writer: {e!r}")
    return threading.Thread(target=run, name="writer")


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its parent has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@contextlib.contextmanager
def _mount(tmp_path: Path, state_dir, threads: str, debug: bool = False, env: dict | None = None):
    """A default mount of a fresh _tree with FANSTORE_FUSE_THREADS=threads: (mount, files)."""
    src = tmp_path / "src"
    files = _tree(src)
    dest = prep_cli(src, tmp_path / "dest")
    with mounted(dest, tmp_path / "mnt", state_dir, local=tmp_path / "local",
                 extra_args=["--debug"] if debug else [],
                 env={**({"FANSTORE_FUSE_THREADS": threads} if threads else {}), **(env or {})}) as m:
        yield m, files


def _thread_policies(pid: int, prefix: str) -> list[int]:
    """The scheduling policy (0 SCHED_OTHER, 3 SCHED_BATCH) of each thread of `pid` whose name
    starts with `prefix`, from /proc/PID/task/TID/stat (field 41)."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            name, rest = stat.split("(", 1)[1].rsplit(")", 1)
            if name.startswith(prefix):
                out.append(int(rest.split()[38]))
    return out


def _read_and_write(m, files: dict[str, bytes], readers: int, passes: int, rounds: int) -> None:
    """`readers` threads read every file `passes` times while a writer writes `rounds` files."""
    errors: list[str] = []
    threads = _readers(m.path, files, readers, passes, errors) + [
        _writer(m.path, files, rounds, errors)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads), "a reader or the writer hung"
    assert errors == []


def _uniques(log: str) -> collections.Counter:
    return collections.Counter(re.findall(r"unique: (\d+), opcode: ", log))


@pytest.mark.timeout(240)
def test_threads_answer_dataset_requests_while_files_are_written(tmp_path, state_dir):
    with _mount(tmp_path, state_dir, "4", debug=True, env=OPENED) as (m, files):
        _read_and_write(m, files, 4, 3, 60)
        c = _shim(m)
        assert c["c_fuse_threads"] == 4, c
        # the dataset's OPEN/RELEASE/LOOKUP/GETATTR on the threads; writes and the written
        # files' requests handed to pyfuse3 (the writer's 60 files need far more than 60)
        assert c["c_thread_answered"] >= 4 * 3 * len(files), c
        assert c["c_thread_handed"] >= 60, c
        assert c["c_opens"] >= 4 * 3 * len(files), c
        log = m.log_text()
        seen = _uniques(log)
        twice = [u for u, k in seen.items() if k > 1]
        assert twice == [], f"requests processed more than once: {twice[:10]}"
        assert len(seen) >= c["c_thread_answered"] + c["c_thread_handed"] - 10, (len(seen), c)
        assert "Traceback" not in log
        st = m.state()
        assert st is not None and st.pids
        m.umount()
    assert m.forced == []
    assert "killed" not in m.umount_result.stdout + m.umount_result.stderr
    for pid in st.pids:
        assert not _running(pid), f"daemon {pid} still running"


@pytest.mark.timeout(120)
def test_external_unmount_ends_the_daemon(tmp_path, state_dir):
    """`fusermount3 -u` from outside: the threads read ENODEV, pyfuse3's loop ends, the daemon
    exits by itself (no SIGKILL needed)."""
    with _mount(tmp_path, state_dir, "") as (m, files):
        rel = sorted(files)[3]
        assert (m.path / rel).read_bytes() == files[rel]
        assert _shim(m)["c_fuse_threads"] == 1  # the default
        unmount_externally(m)


def unmount_externally(m) -> None:
    """`fusermount3 -u` of `m` from outside; its daemons must end by themselves within 30 s,
    with no traceback logged."""
    st = m.state()
    assert st is not None
    pids = list(st.pids)
    subprocess.run(["fusermount3", "-u", str(m.path)], check=True, timeout=30)
    deadline = time.monotonic() + 30
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_running(p) for p in pids), "daemon still running"
    assert "Traceback" not in m.log_text()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("knob", ["", "0"])
def test_request_threads_run_sched_batch_unless_turned_off(tmp_path, state_dir, knob):
    """The request threads run SCHED_BATCH by default (a woken thread does not preempt the reader
    that woke it; docs/performance.md, fifteenth session), SCHED_OTHER with FANSTORE_FUSE_BATCH=0;
    the daemon's other threads keep SCHED_OTHER. Files read byte for byte either way."""
    # the /dev/fuse threads' policy (FUSE over io_uring's ring threads have their own)
    # two request threads and one woken while readers overlap: all three alike
    env = {"FANSTORE_FUSE_URING": "0", "FANSTORE_FUSE_OVERLAP_THREADS": "1",
           **({"FANSTORE_FUSE_BATCH": knob} if knob else {})}
    with _mount(tmp_path, state_dir, "2", env=env) as (m, files):
        _read_and_write(m, files, 2, 1, 6)
        st = m.state()
        assert st is not None and st.pids
        pid = st.pids[0]
        want = 0 if knob == "0" else 3
        assert _thread_policies(pid, "fanstore-fuse") == [want, want, want]
        every = _thread_policies(pid, "")  # Python's and the other C threads: SCHED_OTHER
        assert len(every) > 3 and every.count(3) == (3 if want == 3 else 0), every
        assert set(every) <= {0, 3}, every
        c = _shim(m)
        assert c["c_fuse_threads"] == 2 and c["c_fuse_overlap_threads"] == 1, c
        assert c["c_fuse_batch"] == (0 if knob == "0" else 3), c
        assert c["c_thread_answered"] >= 2 * len(files), c


def _thread_cpus(pid: int, prefix: str) -> dict[str, set[int]]:
    """Each thread of `pid` whose name starts with `prefix`: the CPUs it may run on."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            if name.startswith(prefix):
                out[name] = os.sched_getaffinity(int(tid))
    return out


def _overlapping_cold_readers(m, files: dict[str, bytes], paths: list[Path]) -> dict[str, int]:
    """4 readers at once over cold files, every byte compared; again (up to 3 passes) until
    the overlap thread has read a request (the machine may run them one by one). The counters
    after."""
    errors: list[str] = []
    for _ in range(3):
        drop_page_cache(paths)
        threads = _readers(m.path, files, 4, 1, errors)
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads) and errors == [], errors
        c = _shim(m)
        if c["c_fuse_overlap_reads"] > 0:
            break
    return c


@pytest.mark.timeout(120)
@pytest.mark.parametrize("knob,rank", [("0", ""), ("auto", ""), ("1", ""), ("1", "1")])
def test_request_threads_pinned_one_per_cpu_where_cpus_are_few(tmp_path, state_dir, knob, rank):
    """FANSTORE_FUSE_PIN: "auto" pins the request threads one per CPU of the daemon's affinity
    set when it has no more CPUs than they are (here: 2 request threads and the overlap
    thread), from the node-local rank's offset (MPI_LOCALRANKID); "1" pins them whatever the
    count; "0" never (unset: "overlap", the next test). Files read byte for byte either way."""
    allowed = sorted(os.sched_getaffinity(0))
    env = {"FANSTORE_FUSE_URING": "0", "FANSTORE_FUSE_OVERLAP_THREADS": "1",
           **({"FANSTORE_FUSE_PIN": knob} if knob else {}),
           **({"MPI_LOCALRANKID": rank} if rank else {})}
    with _mount(tmp_path, state_dir, "2", env=env) as (m, files):
        _read_and_write(m, files, 2, 1, 2)
        st = m.state()
        assert st is not None and st.pids
        cpus = _thread_cpus(st.pids[0], "fanstore-fuse")
        assert sorted(cpus) == ["fanstore-fuse0", "fanstore-fuse1", "fanstore-fuse2"], cpus
        pin = len(allowed) >= 2 and (knob == "1" or (knob == "auto" and len(allowed) <= 3))
        c = _shim(m)
        if not pin:
            assert all(v == set(allowed) for v in cpus.values()), (cpus, allowed)
            assert c["c_fuse_pinned"] == 0, c
        else:
            base = int(rank or 0)
            want = {f"fanstore-fuse{k}": {allowed[(base + k) % len(allowed)]} for k in range(3)}
            assert cpus == want, (cpus, want)
            assert c["c_fuse_pinned"] == 3, c
        # Python's threads and the other C threads keep the whole set
        others = _thread_cpus(st.pids[0], "")
        assert all(v == set(allowed) for k, v in others.items()
                   if not k.startswith("fanstore-fuse")), others


@pytest.mark.timeout(180)
@pytest.mark.parametrize("knob", ["", "overlap"])
def test_request_threads_pinned_only_while_reads_overlap(tmp_path, state_dir, knob):
    """FANSTORE_FUSE_PIN=overlap (the default: unset): no pins while one reader reads; when 4
    cold readers' READs overlap, the first overlap thread pins every request thread one per CPU
    (c_fuse_pinned counts them), and once the READs stop overlapping it gives them the whole
    set back before it parks. Every byte compared."""
    allowed = sorted(os.sched_getaffinity(0))
    env = {"FANSTORE_FUSE_URING": "0", **({"FANSTORE_FUSE_PIN": knob} if knob else {})}
    with _mount(tmp_path, state_dir, "", env=env) as (m, files):
        st = m.state()
        assert st is not None and st.pids
        names = sorted(files)
        paths = [m.path / rel for rel in names]
        for rel in names:  # one reader: nothing overlaps, nothing pinned
            assert (m.path / rel).read_bytes() == files[rel]
        c = _shim(m)
        assert c["c_fuse_overlaps"] == 0 and c["c_fuse_pinned"] == 0, c
        assert all(v == set(allowed) for v in _thread_cpus(st.pids[0], "fanstore-fuse").values())
        c = _overlapping_cold_readers(m, files, paths)
        if len(allowed) < 2:  # one CPU: no overlap thread, nothing to pin
            assert c["c_fuse_overlap_threads"] == 0 and c["c_fuse_pinned"] == 0, c
            return
        assert c["c_fuse_overlaps"] >= 1, c
        threads_n = c["c_fuse_threads"] + c["c_fuse_overlap_threads"]
        assert c["c_fuse_pinned"] >= threads_n, c
        # one reader again, slowly: the overlap thread reads one of its requests, finds no
        # overlap, and unpins everyone before it parks
        deadline = time.monotonic() + 30
        while True:
            drop_page_cache(paths[:8])
            for rel in names[:8]:
                assert (m.path / rel).read_bytes() == files[rel]
                time.sleep(0.03)
            cpus = _thread_cpus(st.pids[0], "fanstore-fuse")
            if all(v == set(allowed) for v in cpus.values()) or time.monotonic() > deadline:
                break
        assert all(v == set(allowed) for v in cpus.values()), (cpus, allowed)
        assert "Traceback" not in m.log_text()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("knob", ["", "0", "400"])
def test_request_threads_poll_for_the_next_request_unless_turned_off(tmp_path, state_dir, knob):
    """After each request a thread polls /dev/fuse for up to FANSTORE_FUSE_SPIN_US (default
    50; 0: never) while no CPU is wanted by more tasks than it can run, so one reader's next
    request does not wait for a halted CPU to wake (docs/performance.md, seventeenth session).
    One reader and a writer; every byte compared either way."""
    # the poll is the /dev/fuse threads' (FUSE over io_uring's ring threads take the requests)
    env = {"FANSTORE_FUSE_URING": "0", **({"FANSTORE_FUSE_SPIN_US": knob} if knob else {})}
    with _mount(tmp_path, state_dir, "1", env=env) as (m, files):
        _read_and_write(m, files, 1, 1, 3)
        c = _shim(m)
        for _ in range(4):  # a busy machine refuses the poll while it is busy: read again
            if knob == "0" or c["c_fuse_spin_hits"] > 0:
                break
            errors: list[str] = []
            (reader,) = _readers(m.path, files, 1, 1, errors)
            reader.start()
            reader.join(120)
            assert not reader.is_alive() and errors == []
            c = _shim(m)
        if knob == "0":
            assert c["c_fuse_spins"] == 0 and c["c_fuse_spin_hits"] == 0, c
        else:
            assert c["c_fuse_spins"] > 0 and 0 < c["c_fuse_spin_hits"] <= c["c_fuse_spins"], c
        assert c["c_thread_answered"] >= len(files), c


@pytest.mark.timeout(180)
def test_an_extra_thread_reads_only_while_readers_overlap(tmp_path, state_dir):
    """One request thread by default, and one more (FANSTORE_FUSE_OVERLAP_THREADS, 1) that sleeps
    on its own eventfd until requests come from two readers within 2 ms of each other, then
    reads /dev/fuse too until 20 ms pass without that: a single reader never wakes it (a
    sleeping second reader of /dev/fuse cost one reader ~10% of its warm files/s), 4 readers
    do. Every byte compared."""
    env = {"FANSTORE_FUSE_URING": "0"}  # the /dev/fuse threads (rings take the requests)
    with _mount(tmp_path, state_dir, "", env=env) as (m, files):
        c = _shim(m)
        assert c["c_fuse_threads"] == 1 and c["c_fuse_overlap_threads"] == 1, c
        paths = [m.path / rel for rel in sorted(files)]
        for _ in range(2):  # one reader: this thread, nothing else on the mount
            for rel in sorted(files):
                assert (m.path / rel).read_bytes() == files[rel]
            drop_page_cache(paths)
        c = _shim(m)
        assert c["c_fuse_overlaps"] == 0 and c["c_fuse_overlap_reads"] == 0, c
        c = _overlapping_cold_readers(m, files, paths)
        assert c["c_fuse_overlaps"] >= 1 and c["c_fuse_overlap_reads"] > 0, c
        assert "Traceback" not in m.log_text()


@pytest.mark.timeout(120)
def test_threads_off_keeps_pyfuse3s_loop(tmp_path, state_dir):
    with _mount(tmp_path, state_dir, "0", env=OPENED) as (m, files):
        _read_and_write(m, files, 2, 2, 12)
        c = _shim(m)
        assert c["c_fuse_threads"] == 0 and c["c_thread_answered"] == 0, c
        assert c["c_opens"] >= 2 * 2 * len(files) and c["c_lingered"] > 0, c


@pytest.mark.timeout(180)
def test_concurrent_cold_reads_go_to_the_read_threads(tmp_path, state_dir):
    """16 readers' O_DIRECT 4 KiB reads of a file whose pages are out of the page cache: the
    one FUSE thread must not read them all itself, one disk read at a time, while the others'
    READs wait in /dev/fuse (it polls the descriptor: `fanstore_threads_dev_waiting`); some are
    handed to the READ threads, whose disk reads overlap. Every byte compared."""
    src = tmp_path / "src"
    src.mkdir()
    data = random.Random(4).randbytes(24 << 20)
    (src / "big.bin").write_bytes(data)
    dest = prep_cli(src, tmp_path / "dest")
    with mounted(dest, tmp_path / "mnt", state_dir, local=tmp_path / "local") as m:
        drop_page_cache(list((tmp_path / "local").rglob("*.fsp")))  # the staged copy
        before = _shim(m)
        errors: list[str] = []

        def run(k: int) -> None:
            rng = random.Random(k)
            fd = os.open(m.path / "big.bin", os.O_RDONLY | os.O_DIRECT)
            try:
                for _ in range(150):
                    off = rng.randrange(len(data) >> 12) << 12
                    if os.pread(fd, 4096, off) != data[off:off + 4096]:
                        errors.append(f"reader {k}: bytes at {off} differ")
            except OSError as e:
                errors.append(f"reader {k}: {e!r}")
            finally:
                os.close(fd)

        readers = [threading.Thread(target=run, args=(k,)) for k in range(16)]
        for t in readers:
            t.start()
        for t in readers:
            t.join(120)
        assert not any(t.is_alive() for t in readers) and errors == []
        after = _shim(m)
        reads = after["c_reads"] - before["c_reads"]
        inline = after["c_read_inline"] - before["c_read_inline"]
        assert reads == 16 * 150, (before, after)
        assert inline < reads, (before, after)  # some went to the READ threads
