"""Run on a node inside a job: the mount at $MNT equals SRC (metadata, listings, every byte)."""

import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _harness import assert_same_tree  # noqa: E402

n = assert_same_tree(sys.argv[1], os.environ["MNT"])
print(f"{socket.gethostname()}: {n} entries identical to the source", flush=True)
