"""A log appended on one rank, followed on the others with tail -F and open/read/close polling
(issue 13: close-to-open for new opens, a snapshot that follows appends for open readers)."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
from _harness import prep_cli

pytestmark = [pytest.mark.mount]


@pytest.fixture
def dest(src_tree: Path, tmp_path: Path) -> Path:
    return prep_cli(src_tree, tmp_path / "dest", "--chunk-mib", "1", "-p", "2")


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_a_log_appended_on_one_rank_is_followed_on_the_others(dest: Path, tmp_path: Path,
                                                               mount_factory):
    m = mount_factory(dest, str(tmp_path / "mnt" / "{rank}"), ranks=3,
                      local=str(tmp_path / "local" / "{rank}"))
    r0, r1, r2 = (Path(mp) for mp in m.mountpoints)
    lines = [f"line {i:04d} {'x' * (i % 97)}\n" for i in range(1000)]
    full = "".join(lines)
    (r2 / "logs").mkdir()
    (r2 / "logs" / "train.log").write_text("")
    tail = subprocess.Popen(
        [shutil.which("tail") or "tail", "-F", "-n", "+1", "-s", "0.05",
         os.fspath(r0 / "logs" / "train.log")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tailed: list[str] = []
    assert tail.stdout is not None
    reader = threading.Thread(target=lambda: tailed.extend(tail.stdout or []))
    reader.start()
    seen: list[str] = []
    errors: list[str] = []
    done = threading.Event()

    def poll() -> None:  # open/read/close on rank 1, while the writer appends
        while True:
            last = done.is_set()
            try:
                text = (r1 / "logs" / "train.log").read_text()
            except OSError as e:
                errors.append(f"poll: {e}")
                text = ""
            if not full.startswith(text) or not text.endswith("\n") and text:
                errors.append(f"poll read {len(text)} chars, not a prefix of the log")
            seen.append(text)
            if last:
                return
            time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        for line in lines:
            with open(r2 / "logs" / "train.log", "a") as f:
                f.write(line)
    finally:
        done.set()
        poller.join()
    deadline = time.monotonic() + 60
    while len("".join(tailed)) < len(full) and time.monotonic() < deadline:
        time.sleep(0.05)
    tail.terminate()
    tail.wait(10)
    reader.join()
    err = tail.stderr.read() if tail.stderr else ""
    assert "".join(tailed) == full
    assert "error" not in err.lower(), err
    assert not errors, errors[:5]
    assert seen[-1] == full and len(set(seen)) > 2  # the poller saw the log grow
