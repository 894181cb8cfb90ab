"""The MPI transport between two real ranks (`mpiexec -n 2` of the MPI mpi4py uses), without FUSE:
blobs served on the MPI thread (page cache) and by its disk threads, byte for byte, waited for
with the event loop blocked or through trio; bad ids and malformed frames sent to the inline
path come back as error replies."""

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
from fanstore_fuse._messages import MAX_FRAME
from fanstore_fuse._mpilib import OPEN_MPI, library

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
def test_blobs_through_mpi_ranks_and_error_replies(src_tree, tmp_path):
    dest = prep_cli(src_tree, tmp_path / "dest", "--chunk-mib", "1", "-p", "3")
    client, server = _run(dest, tmp_path / "out", {})
    assert client["fetched"] > 5
    assert client["mismatched"] == []
    assert client["stats"]["remote_reads"] == client["fetched"]
    # alone, a request's reply was waited for with the event loop blocked (each blob was
    # fetched twice), but for SYNC_WAIT at most: a read from the cold disk may take longer and
    # go on through trio (the next BLOCKING_OFF requests then wait through trio too), and the
    # first may find the transport's own task starting (runnable); with a request queued on
    # the session, none was
    assert client["blocked_alone"] > client["fetched"]
    assert client["blocked_alone"] + client["yielded_alone"] <= 2 * client["fetched"]
    assert client["blocked_queued"] == 0 and client["yielded_queued"] >= 1
    # a request of rank 1 for rank 0's trio ended rank 0's blocked wait (rank 1 answered only
    # once rank 0 had answered it), and did not turn blocked waits off
    assert client["ping_back_yielded"] == 1 and client["ping_back_off"] == 0
    assert client["not_held"] == errno.ENOENT
    assert client["past_end"] == errno.ENOENT
    assert client["bad_version"] == errno.EPROTO
    assert client["bad_length"] == errno.EPROTO
    assert client["oversized_request"] == errno.EPROTO  # never allocated by the server
    assert "over the limit" in (client["oversized_reply"] or "")
    if library().family != OPEN_MPI:  # Open MPI takes it into a scratch mapping (_oversized)
        assert max(client["bytes_received"], server["bytes_received"]) < MAX_FRAME  # nor received
    # each fetched blob was asked for twice (stored bytes, then decoded), five again with the
    # session readable, plus 4 bad requests, plus the ping
    assert server["served"] == 2 * client["fetched"] + 5 + 4 + 1
    # the page cache was dropped first: the first requests went to the disk threads, the
    # repeated ones were answered on the MPI thread itself; none but the ping went through trio
    assert server["served_by_io"] > 0
    assert server["served_inline"] > 0
    assert server["served_inline"] + server["served_by_io"] == server["served"] - 1
    # polls back off while nothing arrives: never more than one per POLL_FIRST of the run
    # beside one per frame, and far fewer once idle (_transport's module docstring)
    assert server["polls"] < server["seconds"] / 20e-6 / 4, server


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


def test_the_mpi_thread_sleeps_through_most_of_what_it_expects_and_shrinks_when_it_overslept():
    import threading
    import time

    from fanstore_fuse._transport import POLL_FIRST, ReplyClock, RequestClock, lower_timer_slack

    clock = ReplyClock()
    assert clock.sleep(time.monotonic()) == 0.0  # nothing awaited
    clock.sent(1)
    time.sleep(0.002)
    clock.answered(1)  # arrived while polled for: ~2 ms measured, expected at most LONGEST
    assert clock.estimate == ReplyClock.LONGEST
    before = time.monotonic()
    clock.sent(2)
    assert clock.sleep(before) == ReplyClock.LONGEST  # due an estimate after its send
    clock.first_poll = True  # slept to the expected time...
    clock.answered(2)  # ...and it was there at the first poll: it may have waited
    assert clock.estimate == pytest.approx(0.8 * ReplyClock.LONGEST)
    clock.sent(3)
    clock.sent(4)
    assert clock.awaiting({3, 4})
    assert clock.awaiting({4})  # trio gave up on 3 (a timeout): 4 is still due
    assert not clock.awaiting(set())
    assert clock.sleep(time.monotonic()) == 0.0

    requests = RequestClock()
    requests.arrived()
    first = requests.last
    time.sleep(0.0005)
    requests.arrived()  # a steady reader: the next one a little before the same gap again
    gap = requests.last - first
    assert gap >= 0.0005
    assert requests.estimate == pytest.approx(min(RequestClock.LONGEST, 0.9 * gap))
    assert requests.sleep(requests.last) == pytest.approx(requests.estimate)
    requests.arrived()
    requests.arrived()  # two at once: irregular, no sleep (a gap under POLL_FIRST)
    assert requests.estimate < POLL_FIRST
    assert requests.sleep(requests.last) == 0.0

    lower_timer_slack(2000)
    with open(f"/proc/{threading.get_native_id()}/timerslack_ns") as f:
        assert int(f.read()) == 2000


def test_a_daemon_ends_even_when_its_mpi_thread_is_stuck_in_a_call():
    """MPICH retries a send to a dead peer inside the call: the transport stops waiting for its
    MPI thread after STOP_JOIN seconds, so the daemon still unmounts and cleans up."""
    code = """
import threading, time, trio
from fanstore_fuse._messages import HandlerTable
from fanstore_fuse._transport import MpiTransport

class StuckComm:  # an MPI call that never returns
    def Get_rank(self): return 0
    def Get_size(self): return 2
    def improbe(self, *args): threading.Event().wait()

async def main():
    with trio.move_on_after(0.5):
        await MpiTransport(StuckComm(), HandlerTable()).run()

t0 = time.monotonic()
trio.run(main)
print(time.monotonic() - t0)
"""
    from fanstore_fuse._transport import STOP_JOIN

    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    took = float(p.stdout.strip().splitlines()[-1])
    assert 0.5 + STOP_JOIN - 0.2 < took < 0.5 + STOP_JOIN + 3, took
    assert "did not stop within" in p.stderr
