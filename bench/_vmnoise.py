"""What the VM's host and memory management did during a timed pass: the bench's silent third
party.

- **CPU time stolen by the host** (the steal column of /proc/stat): the vCPUs wanted to run and
  the hypervisor ran something else. FUSE file systems pay it on every round trip between the
  reader and the daemon; ext4 with no daemon much less.

Two kernel features of the bench machine take memory from under a pass:

- **DAMON pageout.** A kdamond (``/sys/kernel/mm/damon/admin/kdamonds/N``) monitors physical
  memory and pages out file pages of regions it finds idle (here: at most one access in a 5 s
  aggregation, aged 60 s, up to 128 MiB per second). A region of long-free memory that a cold
  pass has just filled with page cache can still look idle, so pages a warm pass is about to
  read get dropped, and that pass reads them again through the FUSE daemon or the disk.
- **Free page reporting to the host.** Free memory is handed back to the hypervisor
  (``/sys/module/page_reporting/parameters/reported_kib`` on this VM's kernel); the first write
  into such a page afterwards faults on the host. ``drop_caches`` frees gigabytes that get
  reported, and the next cold pass writes its page cache into them.

`snapshot()` and `since()` read what is cheap to read around every pass: the pages read
again after reclaim took them (``workingset_refault_file`` in /proc/vmstat: with gigabytes
free, nothing but DAMON reclaims here, and drop_caches leaves no trace that would count) and
the bytes reported to the host. `snapshot(damon=True)` adds DAMON's own count of bytes paged
out; refreshing it (a write of ``update_schemes_stats`` to the kdamond's ``state``, root only)
waits for the kdamond's next sample, up to half a second here, so benches take it around a
group of passes, not each one. On a machine without these counters the figures are absent, not
zero. Passes log what happened during them, so a slow pass can be told from a slow system.
"""

from __future__ import annotations

import os
from pathlib import Path

DAMON = Path("/sys/kernel/mm/damon/admin/kdamonds")
REPORTED_KIB = Path("/sys/module/page_reporting/parameters/reported_kib")


def damon_pageout_bytes() -> int | None:
    """Bytes paged out so far by every running kdamond's pageout schemes; None if none runs
    or the stats cannot be refreshed (not root)."""
    total, seen = 0, False
    for kd in sorted(DAMON.glob("[0-9]*")):
        try:
            if (kd / "state").read_text().strip() != "on":
                continue
            (kd / "state").write_text("update_schemes_stats")
        except OSError:
            continue
        for scheme in kd.glob("contexts/*/schemes/[0-9]*"):
            try:
                if (scheme / "action").read_text().strip() != "pageout":
                    continue
                total += int((scheme / "stats" / "sz_applied").read_text())
                seen = True
            except (OSError, ValueError):
                continue
    return total if seen else None


def _reported_bytes() -> int | None:
    try:
        return int(REPORTED_KIB.read_text()) * 1024
    except (OSError, ValueError):
        return None


def _refaulted_bytes() -> int | None:
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("workingset_refault_file "):
                    return int(line.split()[1]) * 4096
    except (OSError, ValueError):
        pass
    return None


def _stolen_ms() -> int | None:
    """CPU time the host took from this VM's vCPUs so far (all of them), in milliseconds."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) * 1000 // os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def snapshot(damon: bool = False) -> dict[str, int | None]:
    snap = {"stolen": _stolen_ms(), "refaulted": _refaulted_bytes(), "reported": _reported_bytes()}
    if damon:
        snap["damon_pageout"] = damon_pageout_bytes()
    return snap


def since(before: dict[str, int | None]) -> dict[str, float]:
    """Since `before`: ms stolen, MiB refaulted, paged out by DAMON and reported to the host
    (keys absent when the machine has no such counter)."""
    now = snapshot(damon="damon_pageout" in before)
    return {(f"{k}_ms" if k == "stolen" else f"{k}_mib"):
            (now[k] - b if k == "stolen" else round((now[k] - b) / (1 << 20), 1))  # type: ignore[operator]
            for k, b in before.items() if b is not None and now.get(k) is not None}


def describe(d: dict[str, float]) -> str:
    """'' when nothing happened, else e.g. ' [vm: 12 MiB refaulted, 410 MiB reported to the
    host]'."""
    parts = []
    if d.get("stolen_ms", 0) >= 10:
        parts.append(f"{d['stolen_ms']:.0f} ms of CPU stolen by the host")
    if d.get("refaulted_mib", 0) >= 1:
        parts.append(f"{d['refaulted_mib']:.0f} MiB refaulted")
    if d.get("damon_pageout_mib", 0) >= 1:
        parts.append(f"DAMON paged out {d['damon_pageout_mib']:.0f} MiB")
    if d.get("reported_mib", 0) >= 1:
        parts.append(f"{d['reported_mib']:.0f} MiB reported to the host")
    return f" [vm: {', '.join(parts)}]" if parts else ""
