"""Run a bench with this VM's free page reporting held back: ``python -m bench.calm CMD ...``.

This machine's kernel hands free memory back to the hypervisor (free page reporting,
bench/_vmnoise.py). ``drop_caches`` before every cold pass frees gigabytes, which are reported
at once (``min_free_ms`` 0), and the next pass writes its page cache and buffers into memory the
host must fault in again. Runs that land there copy 3-4x slower: the "sporadic slow runs" of
docs/performance.md, which hit every system (squashfuse's seq1M runs of 597-827 MiB/s beside
2,025-2,119 in one run; fanstore-fuse's 627-907 beside 1,569-1,720 in another). A cluster node
on bare metal has no such step.

While CMD runs, reporting waits `--hold-ms` (default 60 s) after memory is freed, so the
memory a pass frees is still backed when the next pass takes it; every system in the run is
measured under the same setting. The old value is put back when CMD ends (also on Ctrl-C or a
failure). Where the knob is absent (another kernel) or not writable (not root), CMD runs as it
is; a line says which. The exit status is CMD's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

MIN_FREE_MS = Path("/sys/module/page_reporting/parameters/min_free_ms")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    hold = 60000
    if args[:1] == ["--hold-ms"] and len(args) > 1:
        hold, args = int(args[1]), args[2:]
    if not args:
        print(__doc__.split("\n")[0], file=sys.stderr)
        return 2
    old = None
    try:
        old = MIN_FREE_MS.read_text().strip()
        MIN_FREE_MS.write_text(str(hold))
        print(f"[calm] free page reporting held back {hold} ms while this runs (was {old})",
              flush=True)
    except OSError as e:
        print(f"[calm] free page reporting left as it is ({MIN_FREE_MS}: {e.strerror})",
              flush=True)
        old = None
    try:
        return subprocess.call(args)
    except KeyboardInterrupt:
        return 130
    finally:
        if old is not None:
            MIN_FREE_MS.write_text(old)


if __name__ == "__main__":
    sys.exit(main())
