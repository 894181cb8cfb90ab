"""Run on a node inside a job: 4 threads read every regular file of the mount at $MNT, each in
its own shuffled order, byte for byte against SRC (argv[1]), and print what this node's daemon
counted: its errors and the blobs it read from other nodes."""

import json
import os
import random
import socket
import sys
import threading

mnt, src, host = os.environ["MNT"], sys.argv[1], socket.gethostname()
rels = sorted(os.path.relpath(os.path.join(d, f), src) for d, _, fs in os.walk(src) for f in fs
              if os.path.isfile(os.path.join(d, f)) and not os.path.islink(os.path.join(d, f)))
errors: list[str] = []


def read_all(k: int) -> None:
    order = list(rels)
    random.Random(k).shuffle(order)
    for rel in order:
        try:
            with open(os.path.join(mnt, rel), "rb", buffering=0) as f:
                got = f.read()
            with open(os.path.join(src, rel), "rb") as f:
                want = f.read()
            if got != want:
                errors.append(f"reader {k}: {rel} differs")
        except OSError as e:
            errors.append(f"reader {k}: {rel}: {e!r}")


threads = [threading.Thread(target=read_all, args=(k,)) for k in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
st = json.loads(os.getxattr(mnt, "user.fanstore.status"))
(me,) = [r for r in (st["ranks"] if isinstance(st, dict) else st) if r.get("host") == host]
print(f"{host}: 4 readers: {len(rels)} files each, errors {len(errors)} {errors[:3]}; "
      f"daemon errors {me['stats']['errors']}; remote reads {me['stats']['remote_reads']}", flush=True)
sys.exit(1 if errors else 0)
