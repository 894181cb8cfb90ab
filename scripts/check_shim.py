"""Fail the install when the C shim (`fanstore_fuse._noflush`, an optional extension) did not
build from the current sources: pip only warns when an optional extension fails to compile, and
a stale module from an earlier build would then run, or none, with every test that needs it
skipped. FANSTORE_NO_SHIM=1 accepts a build without it (a machine with no compiler)."""

from __future__ import annotations

import glob
import os
import sys


def main() -> int:
    if os.environ.get("FANSTORE_NO_SHIM") == "1":
        return 0
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "fanstore_fuse")
    try:
        from fanstore_fuse import _noflush
    except ImportError as e:
        print(f"check_shim: the C shim did not build ({e}); run `.venv/bin/pip install -v -e .` "
              "to see the compiler's errors (FANSTORE_NO_SHIM=1 accepts a build without it)")
        return 1
    built = os.path.getmtime(_noflush.__file__)
    sources = glob.glob(os.path.join(here, "*.c")) + glob.glob(os.path.join(here, "*.h"))
    stale = [os.path.basename(p) for p in sources if os.path.getmtime(p) > built]
    if stale:
        print(f"check_shim: {_noflush.__file__} is older than {', '.join(sorted(stale))}: the "
              "last build failed; run `.venv/bin/pip install -v -e .` to see the compiler's errors")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
