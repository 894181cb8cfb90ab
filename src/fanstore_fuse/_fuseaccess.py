"""Why a non-root user cannot mount, in one line with the fix (checked before staging in).

A non-root FUSE mount needs read-write access to /dev/fuse (libfuse opens it as the user; it
is 0600 root on many clusters), a setuid-root `fusermount3` (which does the mount(2) itself),
and, for `-o allow_other`, a `user_allow_other` line in /etc/fuse.conf.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import stat

FUSE_DEV = "/dev/fuse"
FUSE_CONF = "/etc/fuse.conf"
_PROLOG = "or have the SLURM prolog mount it for you as root"


def _owner(st: os.stat_result) -> str:
    try:
        user = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        user = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return f"{user}:{group}"


def fuse_access_problem(options: set[str] | list[str]) -> str | None:
    """None when this user can mount with `options`; else the cause and a fix, one line."""
    uid = os.geteuid()
    if uid == 0:
        return None
    who = f"uid {uid}"
    try:
        st = os.stat(FUSE_DEV)
    except OSError:
        return (f"cannot mount as {who}: {FUSE_DEV} is missing; fix: load the fuse module "
                f"(modprobe fuse) on the node, {_PROLOG}")
    if not os.access(FUSE_DEV, os.R_OK | os.W_OK):
        return (f"cannot mount as {who}: {FUSE_DEV} is mode {stat.S_IMODE(st.st_mode):04o} "
                f"({_owner(st)}), which you cannot open read-write; fix: an admin gives it to a "
                f"group of yours (chgrp fuse {FUSE_DEV}; chmod 0660 {FUSE_DEV}) with fusermount3 "
                f"setuid root, {_PROLOG}")
    fm = shutil.which("fusermount3")
    fst = os.stat(fm) if fm else None
    if fst is None or fst.st_uid != 0 or not fst.st_mode & stat.S_ISUID:
        what = f"{fm} is not setuid root" if fm else "fusermount3 is not installed"
        return (f"cannot mount as {who}: {what}, and non-root FUSE mounts need it; fix: an admin "
                f"installs fuse3 with fusermount3 setuid root (chmod u+s), {_PROLOG}")
    if "allow_other" in options and not _user_allow_other():
        return (f"cannot mount as {who} with -o allow_other: {FUSE_CONF} has no "
                "user_allow_other line; fix: mount without allow_other (only you can read it), "
                f"ask an admin to add user_allow_other to {FUSE_CONF}, {_PROLOG}")
    return None


def _user_allow_other() -> bool:
    try:
        with open(FUSE_CONF) as f:
            return any(line.strip() == "user_allow_other" for line in f)
    except OSError:
        return True  # unreadable here: fusermount3 reads it as root, let it decide


def mount_failure(error: str, options: set[str] | list[str]) -> str:
    """The line for a failed `pyfuse3.init` (`fuse_session_mount failed` says nothing)."""
    problem = fuse_access_problem(options)
    return problem or f"FUSE mount failed ({error}): see the daemon log for libfuse's reason"
