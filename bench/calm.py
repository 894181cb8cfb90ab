"""Run a bench with this VM's free page reporting held back: ``python -m bench.calm CMD ...``.

This machine's kernel hands free memory back to the hypervisor (free page reporting,
bench/_vmnoise.py). ``drop_caches`` before every cold pass frees gigabytes, which are reported
at once (``min_free_ms`` 0), and the next pass writes its page cache and buffers into memory the
host must fault in again. Runs that land there copy several times slower, whatever the
system. A cluster node on bare metal has no such step.

While CMD runs, reporting waits `--hold-ms` (default 300 s, the most this kernel takes) after
memory is freed, and holds back up to the machine's memory (`max_waiting_mib`, default 1024:
past it, freed memory went to the host at once, so `drop_caches` still handed gigabytes back),
so the memory a pass frees is still backed when the next pass takes it;
every system in the run is measured under the same setting.

Memory this VM has not touched since it booted (or since it was last reported) is not backed
either: the first write to each page waits for the host, and whatever phase of a bench first
takes such pages pays it (a pass copying into fresh page cache, say). So before CMD runs,
`--prefault-gib` (default 6; 0: none) GiB are written once and freed while reporting is held
back: the pages the bench then takes within the hold are backed. The hold is long (300 s):
a pass that runs after it has ended may find its memory reported again (bench/_vmnoise.py
logs it).

The old value is put back when CMD ends (also on Ctrl-C or a failure). Where the knob is absent
(another kernel) or not writable (not root), CMD runs as it is, without a prefault; a line says
which. The exit status is CMD's.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

MIN_FREE_MS = Path("/sys/module/page_reporting/parameters/min_free_ms")
# Past this many MiB waiting, freed memory is reported at once whatever min_free_ms says;
# raised to the machine's memory while CMD runs.
MAX_WAITING_MIB = Path("/sys/module/page_reporting/parameters/max_waiting_mib")


MADV_POPULATE_WRITE = 23  # Linux 5.14; mmap has no name for it before Python 3.13


def touch(nbytes: int) -> None:
    """Write `nbytes` of anonymous memory once, then free it: the host backs those pages."""
    t0 = time.monotonic()
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(MADV_POPULATE_WRITE)
    except OSError:  # an older kernel: write a byte in each page
        for off in range(0, nbytes, mmap.PAGESIZE):
            m[off] = 1
    m.close()
    print(f"[calm] {nbytes >> 30} GiB of memory touched and freed in "
          f"{time.monotonic() - t0:.1f} s", flush=True)


def _set(knobs: dict[Path, str], old: dict[Path, str]) -> None:
    """Write each knob, recording in `old` the value it had (put back by `_set(old, {})`)."""
    for path, value in knobs.items():
        was = path.read_text().strip()
        path.write_text(value)
        old[path] = was


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    hold = 300000
    prefault = 6
    while len(args) > 1 and args[0] in ("--hold-ms", "--prefault-gib"):
        if args[0] == "--hold-ms":
            hold = int(args[1])
        else:
            prefault = int(args[1])
        args = args[2:]
    if not args:
        print(__doc__.split("\n")[0], file=sys.stderr)
        return 2
    old: dict[Path, str] = {}
    try:
        total_mib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 20
        _set({MIN_FREE_MS: str(hold), MAX_WAITING_MIB: str(total_mib)}, old)
        print(f"[calm] free page reporting held back {hold} ms and up to {total_mib} MiB while "
              f"this runs (was {old[MIN_FREE_MS]} ms, {old[MAX_WAITING_MIB]} MiB)", flush=True)
        if prefault > 0:
            touch(prefault << 30)
    except OSError as e:
        print(f"[calm] free page reporting left as it is ({e.filename}: {e.strerror})",
              flush=True)
        _set(old, {})
        old = {}
    try:
        return subprocess.call(args)
    except KeyboardInterrupt:
        return 130
    finally:
        _set(old, {})


if __name__ == "__main__":
    sys.exit(main())
