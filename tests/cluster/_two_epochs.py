"""Run on a node inside a job: read the mount at $MNT twice, byte for byte against SRC, the
kernel's cached pages of the files dropped in between, and print what this node's daemon
fetched from other nodes in each epoch and how often its disk cache answered in the second."""

import json
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _harness import assert_same_tree  # noqa: E402

mnt, host = os.environ["MNT"], socket.gethostname()


def mine() -> dict:
    """This node's rank in the status the mount root reports (`user.fanstore.status`)."""
    st = json.loads(os.getxattr(mnt, "user.fanstore.status"))
    ranks = st["ranks"] if isinstance(st, dict) else st
    (me,) = [r for r in ranks if r.get("host") == host]
    return me


n = assert_same_tree(sys.argv[1], mnt)
time.sleep(1.0)  # let the cache's writer thread land the last blobs of epoch 1
before = mine()
for root, _, files in os.walk(mnt):
    for f in files:
        path = os.path.join(root, f)
        if os.path.islink(path) or not os.path.isfile(path):
            continue
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
n2 = assert_same_tree(sys.argv[1], mnt)
after = mine()
fetched = after["stats"]["remote_reads"] - before["stats"]["remote_reads"]
hits = after["disk_cache"]["hits"] - before["disk_cache"]["hits"]
# BlobCache keeps the last BIG_SLOTS blobs larger than FANSTORE_CACHE_BYTES: some may still be in memory
mem = after["stats"]["cache_hits"] - before["stats"]["cache_hits"]
print(f"{host}: epoch 1: remote reads {before['stats']['remote_reads']}, "
      f"requests served {before['requests_served']}, "
      f"MPI bytes received {before['mpi_bytes_received']}; errors {before['stats']['errors']}",
      flush=True)
print(f"{host}: epoch 2: {n2} entries identical; fetched from other nodes {fetched}; "
      f"blob cache hits {mem}; "
      f"disk cache hits {hits}; cached blobs {after['disk_cache']['entries']}", flush=True)
