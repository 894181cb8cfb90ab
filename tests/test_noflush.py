"""FOPEN_NOFLUSH: on the default (writable) mount, closing a file opened read-only sends no FUSE
FLUSH; closing a written file still does, and commits it (close-to-open)."""

from __future__ import annotations

import importlib.util
import re
import time

import pytest
from _harness import mounted, prep_cli

pytestmark = [pytest.mark.mount]


def _ops_until(m, done, timeout: float = 20.0) -> list[str]:
    """The FUSE opcodes of interest in the daemon's debug log, once `done(ops)` or at timeout."""
    deadline = time.monotonic() + timeout
    while True:
        ops = re.findall(r"opcode: (OPEN|FLUSH|RELEASE|CREATE) ", m.log_text())
        if done(ops) or time.monotonic() > deadline:
            return ops
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_read_only_opens_are_not_flushed_written_files_are(tmp_path, state_dir):
    if importlib.util.find_spec("fanstore_fuse._noflush") is None:
        pytest.fail("the _noflush shim is not built (pip install -e . needs fuse3 headers and cc)")
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    data = {f"f{i}": bytes([i]) * (5000 + i) for i in range(3)}
    for name, body in data.items():
        (src / "d" / name).write_bytes(body)
    dest = prep_cli(src, tmp_path / "dest")
    with mounted(dest, tmp_path / "mnt", state_dir, local=tmp_path / "local",
                 extra_args=["--debug"]) as m:
        for name, body in data.items():
            assert (m.path / "d" / name).read_bytes() == body
        ops = _ops_until(m, lambda ops: ops.count("RELEASE") >= 3)  # RELEASE is asynchronous
        assert ops.count("OPEN") >= 3 and ops.count("RELEASE") >= 3, ops
        assert "FLUSH" not in ops, ops
        (m.path / "new.txt").write_bytes(b"written")
        assert (m.path / "new.txt").read_bytes() == b"written"
        ops = _ops_until(m, lambda ops: ops.count("RELEASE") >= 5)
        assert "CREATE" in ops and "FLUSH" in ops, ops
        assert ops[ops.index("CREATE"):].count("FLUSH") >= 1
