"""The MPI transport between two real ranks (`mpiexec -n 2` of the MPI mpi4py uses), without FUSE:
blobs served on the MPI thread (page cache) and by its disk threads, byte for byte; bad ids
and malformed frames sent to the inline path come back as error replies."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _harness import prep_cli

from fanstore_fuse._launch import launcher_command

pytestmark = [pytest.mark.mpi]

HERE = Path(__file__).parent


def _run(dest: Path, out: Path, env: dict[str, str]) -> list[dict]:
    out.mkdir()
    p = subprocess.run([*launcher_command(2), sys.executable, str(HERE / "_transport_ranks.py"),
                        str(dest), str(out)], env={**os.environ, **env}, capture_output=True,
                       text=True, timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("inline", ["1", "0"])
def test_blobs_through_mpi_ranks_and_error_replies(src_tree, tmp_path, inline):
    """inline=1: the defaults (inline blobs, doorbells); inline=0: trio serves, no doorbells."""
    dest = prep_cli(src_tree, tmp_path / "dest", "--chunk-mib", "1", "-p", "3")
    client, server = _run(dest, tmp_path / "out", {"FANSTORE_MPI_INLINE": inline,
                                                    "FANSTORE_MPI_DOORBELL": inline})
    assert client["fetched"] > 5
    assert client["mismatched"] == []
    assert client["stats"]["remote_reads"] == client["fetched"]
    assert client["not_held"] == errno.ENOENT
    assert client["past_end"] == errno.ENOENT
    assert client["bad_version"] == errno.EPROTO
    assert client["bad_length"] == errno.EPROTO
    # each fetched blob was asked for twice (stored bytes, then decoded), plus 4 bad requests
    assert server["served"] == 2 * client["fetched"] + 4
    if inline == "1":
        # the page cache was dropped first: the first requests went to the disk threads, the
        # repeated ones were answered on the MPI thread itself; none went through trio
        assert server["served_by_io"] > 0
        assert server["served_inline"] > 0
        assert server["served_inline"] + server["served_by_io"] == server["served"]
        # the requests rang the server's doorbell: it slept between them, not polled. A
        # request that comes while the server still polls after its last answer needs no
        # bell: a clean-clone CI run (twenty-second session) saw 20 wakes for 82 requests,
        # other runs half or more, so the share asked for is a fifth
        assert server["bell_wakes"] >= server["served"] // 5, server
        assert server["polls"] < 50 * server["served"], server
    else:
        assert server["served_inline"] == server["served_by_io"] == server["bell_wakes"] == 0


def test_large_tcp_messages_go_by_rendezvous_unless_the_environment_says_otherwise():
    """`mpi_env_defaults` (what a daemon sets before `MPI_Init`): libfabric's TCP provider takes
    messages above TCP_SAVED_BYTES by rendezvous, so a 4 MiB reply lands in the buffer matched
    for it, not in the provider's own and then copied; a whole small blob's reply stays eager.
    A value the user set wins, as for MPICH's shared-memory settings."""
    from fanstore_fuse._transport import EAGER_BYTES, TCP_SAVED_BYTES, mpi_env_defaults

    env = {"SLURM_JOB_ID": "7"}  # inside a job: MPICH's shared-memory settings are left alone
    mpi_env_defaults(env)
    assert env == {"SLURM_JOB_ID": "7", "FI_TCP_MAX_SAVED_SIZE": str(TCP_SAVED_BYTES)}
    assert EAGER_BYTES < TCP_SAVED_BYTES < 4 << 20
    env = {"SLURM_JOB_ID": "7", "FI_TCP_MAX_SAVED_SIZE": "18446744073709551615"}
    mpi_env_defaults(env)
    assert env["FI_TCP_MAX_SAVED_SIZE"] == "18446744073709551615"
