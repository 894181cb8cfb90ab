"""A shared cluster is hostile: each case is a real run of the CLI, with a second, unprivileged
user (created here with useradd, removed after) where another user is the point.

- DEST: prep keeps it as private as the source; `verify`/`mount` warn once it was widened.
- State dir: one pre-created by another user (or a log name planted as a symlink) is refused,
  and the file the symlink points at is unchanged (bytes and mtime).
- Stage-out: a symlink planted in DIR (top or nested) is refused, the directory it points at is
  unchanged, and the written files stay in the local dir (recover gets them back).
- Unprivileged mounts: /dev/fuse 0600, allow_other without user_allow_other and an unusable
  state dir each give one line with the cause and a fix. The device node and fuse.conf are
  replaced only inside a private mount namespace (`unshare --mount`), never on the machine.

See docs/reliability.md ("Hostile users") for the results.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from _harness import all_recorded_pids, cli_env, fuse_mounts, fuse_mounts_under, mounted, run_cli

from fanstore_fuse._mountctl import default_state_dir, mount_key
from fanstore_fuse._perms import ACCESS_XATTR

pytestmark = pytest.mark.fault
WIDE = {"COLUMNS": "400"}


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int


def _retry(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    """useradd/userdel fail while another process holds the passwd lock: retry a while."""
    for _ in range(60):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if r.returncode == 0 or "lock" not in r.stderr:
            return r
        time.sleep(0.5)
    return r


@pytest.fixture(scope="module")
def other() -> Iterator[User]:
    """A throwaway system user with its own group."""
    name = f"fsec{os.getpid() % 100000}"
    r = _retry(["useradd", "--system", "--no-create-home", "--user-group",
                "--shell", "/usr/sbin/nologin", name])
    assert r.returncode == 0, r.stderr
    pw = pwd.getpwnam(name)
    try:
        yield User(name, pw.pw_uid, pw.pw_gid)
    finally:
        r = _retry(["userdel", name])
        assert r.returncode == 0, r.stderr


def _user_cli() -> tuple[list[str], str]:
    """The CLI as another user runs it: this interpreter when they may execute it, else the
    system python3 with this environment's packages on PYTHONPATH (a venv whose interpreter
    lives under a 0700 home cannot be executed by anyone else)."""
    import sysconfig

    import fanstore_fuse

    path = os.pathsep.join([str(Path(fanstore_fuse.__file__).parents[1]),
                            sysconfig.get_paths()["purelib"]])
    return ["/usr/bin/python3", "-m", "fanstore_fuse"], path


USER_CLI, USER_PYTHONPATH = _user_cli()


def _setpriv(u: User) -> list[str]:
    return ["setpriv", f"--reuid={u.uid}", f"--regid={u.gid}", "--clear-groups", "--"]


def as_user(u: User, *cmd: str | os.PathLike[str], env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*_setpriv(u), *(os.fspath(c) for c in cmd)], env=env, capture_output=True, text=True,
        errors="replace", timeout=timeout, stdin=subprocess.DEVNULL,
    )


@pytest.fixture
def pub() -> Iterator[Path]:
    """A directory every user may enter (pytest's tmp dirs are 0700, which would hide
    everything from the second user before any of our checks)."""
    d = Path(tempfile.mkdtemp(prefix="fanstore-security-", dir="/tmp"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        for mp in fuse_mounts_under(d):
            subprocess.run(["fusermount3", "-u", "-z", mp], capture_output=True, timeout=30)
        shutil.rmtree(d, ignore_errors=True)


def _tree(root: Path, marker: bytes, file_mode: int, dir_mode: int, gid: int = -1) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_bytes(b"a " + marker + b"\n")
    (root / "sub" / "b.bin").write_bytes(os.urandom(3000) + marker)
    for p in (root / "a.txt", root / "sub" / "b.bin"):
        os.chown(p, -1, gid)
        os.chmod(p, file_mode)
    for p in (root / "sub", root):
        os.chown(p, -1, gid)
        os.chmod(p, dir_mode)
    return root


def _modes(dest: Path) -> dict[str, int]:
    out = {".": stat.S_IMODE(dest.stat().st_mode)}
    out.update({p.name: stat.S_IMODE(p.stat().st_mode) for p in dest.iterdir()})
    return out


def _one_line(r: subprocess.CompletedProcess[str]) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1, (r.returncode, r.stderr)
    assert lines[0].startswith("fanstore-fuse: ") and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def _file_state(p: Path) -> tuple[bytes, int, int]:
    st = os.lstat(p)
    return p.read_bytes(), st.st_mtime_ns, st.st_mode


# ------------------------------------------------------------------------------ DEST


@pytest.mark.timeout(120)
def test_dest_is_as_private_as_its_source(pub: Path, other: User):
    """A source with one 0600 file (or under a 0700 directory) gives a DEST the second user
    cannot read (grep finds nothing, cat fails); a group-readable source gives DEST to that
    group (the second user's); a world-readable one stays world-readable."""
    marker = b"PRIVATE-" + os.urandom(6).hex().encode()
    private = _tree(pub / "private", marker, 0o644, 0o755)
    os.chmod(private / "a.txt", 0o600)  # one private file makes the whole DEST private
    hidden = _tree(pub / "home" / "ds", marker, 0o644, 0o755)
    os.chmod(pub / "home", 0o700)  # readable files, but under a directory only root enters
    grouped = _tree(pub / "grouped", marker, 0o640, 0o750, gid=other.gid)
    public = _tree(pub / "public", marker, 0o644, 0o755)
    dests = {}
    for name, src in [("private", private), ("hidden", hidden), ("grouped", grouped),
                      ("public", public)]:
        dests[name] = pub / f"dest-{name}"
        run_cli("prep", src, dests[name], "--partitions", "2", "--codec", "none", "--quiet")

    for name in ("private", "hidden"):
        d = dests[name]
        assert _modes(d) == {".": 0o700, "manifest.fsm": 0o600, "part-00000.fsp": 0o600,
                             "part-00001.fsp": 0o600}, name
        r = as_user(other, "grep", "-rl", marker.decode(), d)
        assert r.returncode == 2 and r.stdout == "" and "Permission denied" in r.stderr, r
        r = as_user(other, "cat", d / "part-00000.fsp")
        assert r.returncode != 0 and "Permission denied" in r.stderr, r
        assert marker in (d / "part-00000.fsp").read_bytes() + (d / "part-00001.fsp").read_bytes()
    g = dests["grouped"]
    assert _modes(g) == {".": 0o750, "manifest.fsm": 0o640, "part-00000.fsp": 0o640,
                         "part-00001.fsp": 0o640}
    assert {p.stat().st_gid for p in [g, *g.iterdir()]} == {other.gid}
    assert os.getxattr(g, ACCESS_XATTR) == f"fanstore-access 1 group:{other.gid}".encode()
    for name in ("grouped", "public"):
        r = as_user(other, "grep", "-rl", marker.decode(), dests[name])
        assert r.returncode == 0 and r.stdout.strip(), (name, r)
    assert _modes(dests["public"])["part-00000.fsp"] == 0o644
    # --mode shares on purpose; --group of a group that does not exist is a one-line error.
    run_cli("prep", private, pub / "shared", "--mode", "0644", "--quiet")
    assert as_user(other, "grep", "-rl", marker.decode(), pub / "shared").returncode == 0
    r = run_cli("prep", private, pub / "bad", "--group", "no-such-group-here", env=cli_env(**WIDE),
                check=False)
    assert "no group named" in _one_line(r)


@pytest.mark.mount
@pytest.mark.timeout(180)
def test_verify_and_mount_warn_on_a_widened_dest(pub: Path, other: User, tmp_path: Path):
    """After `chmod -R a+rX DEST` of a private dataset, verify and mount each print one warning
    line (and still work); without the recorded access (xattr gone) the manifest's modes give
    the same answer; a DEST shared with --mode is not warned about."""
    marker = b"WIDENED-" + os.urandom(6).hex().encode()
    src = _tree(pub / "src", marker, 0o600, 0o700)
    dest = pub / "dest"
    run_cli("prep", src, dest, "--partitions", "2", "--quiet")
    env = cli_env(tmp_path / "state", **WIDE)
    r = run_cli("verify", dest, env=env)
    assert "warning" not in r.stderr and r.stdout.strip().endswith("OK"), r
    for p in [dest, *dest.iterdir()]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    assert as_user(other, "grep", "-rl", marker.decode(), dest).returncode == 0  # a real leak

    def warning(r: subprocess.CompletedProcess[str]) -> str:
        lines = [ln for ln in r.stderr.splitlines() if "warning" in ln]
        assert len(lines) == 1, r.stderr
        assert "readable by everyone" in lines[0] and "its owner only" in lines[0], lines[0]
        assert f"chmod -R go-rwx {dest}" in lines[0], lines[0]
        return lines[0]

    r = run_cli("verify", dest, env=env)
    assert r.stdout.strip().endswith("OK")
    print(warning(r))
    os.removexattr(dest, ACCESS_XATTR)  # e.g. copied by a tool that drops xattrs
    warning(run_cli("verify", dest, env=env))
    with mounted(dest, tmp_path / "mp", tmp_path / "state", local=tmp_path / "local", env=WIDE) as m:
        warning(m.result)
        assert (m.path / "a.txt").read_bytes() == b"a " + marker + b"\n"
        m.umount()
    run_cli("prep", src, pub / "shared", "--mode", "0644", "--quiet")
    r = run_cli("verify", pub / "shared", env=env)
    assert "warning" not in r.stderr, r.stderr


# ------------------------------------------------------------------------------ state dir


@pytest.mark.mount
@pytest.mark.timeout(180)
def test_state_dir_made_by_another_user_is_refused(pub: Path, other: User, tmp_path: Path):
    """The issue's attack: under a world-writable TMPDIR the second user pre-creates root's
    default state dir and plants the mount's log name as a symlink to a root-only file. The
    mount (and umount, status) refuse in one line; the file keeps its bytes and mtime."""
    tmpdir = pub / "tmp"
    tmpdir.mkdir()
    os.chmod(tmpdir, 0o1777)
    target = pub / "root-only"
    target.write_bytes(b"root's own file\n")
    os.chmod(target, 0o600)
    os.utime(target, ns=(1_600_000_000_000_000_000, 1_600_000_000_000_000_000))
    before = _file_state(target)
    src = _tree(tmp_path / "src", b"x", 0o644, 0o755)
    dest = tmp_path / "dest"
    run_cli("prep", src, dest, "--quiet")
    mp = tmp_path / "mp"
    mp.mkdir()
    planted = tmpdir / f"fanstore-fuse-{os.getuid()}"
    r = as_user(other, "sh", "-c", f"mkdir -m 777 {planted} && ln -s {target} "
                f"{planted}/{mount_key(str(mp))}.log")
    assert r.returncode == 0, r.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("FANSTORE_STATE_DIR", "XDG_RUNTIME_DIR")}
    env.update(TMPDIR=str(tmpdir), **WIDE)
    try:
        for args in (["mount", dest, mp], ["umount", mp], ["status", mp]):
            line = _one_line(run_cli(*args, env=env, check=False))
            assert f"belongs to uid {other.uid}" in line, line
            assert str(mp) not in fuse_mounts()
        # --local in a directory of the other user is refused as well (with a good state dir).
        theirs = tmpdir / "theirs"
        assert as_user(other, "mkdir", "-m", "755", theirs).returncode == 0
        line = _one_line(run_cli("mount", dest, mp, "--local", theirs / "l",
                                 env=cli_env(tmp_path / "state", **WIDE), check=False))
        assert "local directory" in line and f"uid {other.uid}" in line, line
        assert not (theirs / "l").exists() and str(mp) not in fuse_mounts()
        # Even in a directory of our own, a log name that is a symlink is not written through.
        own = tmp_path / "own-state"
        own.mkdir(mode=0o700)
        (own / f"{mount_key(str(mp))}.log").symlink_to(target)
        line = _one_line(run_cli("mount", dest, mp, env=cli_env(own, **WIDE), check=False))
        assert "is a symlink" in line, line
        # A state dir of ours that others may write to is refused.
        os.chmod(own, 0o777)
        line = _one_line(run_cli("umount", mp, env=cli_env(own, **WIDE), check=False))
        assert "writable by other users" in line, line
    finally:
        for pid in all_recorded_pids(planted) + all_recorded_pids(tmp_path / "own-state"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if str(mp) in fuse_mounts():
            subprocess.run(["fusermount3", "-u", "-z", str(mp)], timeout=30)
    assert _file_state(target) == before
    assert str(mp) not in fuse_mounts() and os.listdir(mp) == []


def test_xdg_runtime_dir_is_preferred_only_when_private(tmp_path: Path, monkeypatch):
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert default_state_dir() == str(xdg / "fanstore-fuse")
    os.chmod(xdg, 0o755)  # not private: back to $TMPDIR
    assert default_state_dir() == os.path.join(tempfile.gettempdir(), f"fanstore-fuse-{os.getuid()}")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "relative/path")
    assert not default_state_dir().startswith("relative")


# ------------------------------------------------------------------------------ stage-out


def _dir_state(d: Path) -> dict[str, tuple[int, int, int]]:
    out = {}
    for p in [d, *d.rglob("*")]:
        st = os.lstat(p)
        out[str(p.relative_to(d))] = (st.st_mode, st.st_mtime_ns, st.st_size)
    return out


@pytest.mark.mount
@pytest.mark.timeout(180)
def test_stage_out_refuses_symlinks_planted_in_dir(pub: Path, other: User, tmp_path: Path,
                                                   mount_factory):
    """The second user plants `OUT/logs -> outside` and `OUT/deep/x -> outside2` in a shared
    (1777) OUT. `umount --stage-out OUT` saves what it can, refuses both symlinks in one line
    each, keeps the local copy; the outside directories keep their mode, mtime and listing;
    `recover` into a clean directory gets every written file back byte for byte."""
    src = _tree(tmp_path / "src", b"x", 0o644, 0o755)
    dest = tmp_path / "dest"
    run_cli("prep", src, dest, "--quiet")
    outside, outside2 = pub / "outside", pub / "outside2"
    for d in (outside, outside2):
        d.mkdir()
        (d / "keep").write_bytes(b"keep\n")
        os.chmod(d, 0o711)
        os.utime(d, ns=(1_500_000_000_000_000_000, 1_500_000_000_000_000_000))
    before = {d: _dir_state(d) for d in (outside, outside2)}
    out = pub / "out"
    out.mkdir()
    os.chmod(out, 0o1777)
    r = as_user(other, "sh", "-c", f"ln -s {outside} {out}/logs && mkdir -m 777 {out}/deep && "
                f"ln -s {outside2} {out}/deep/x")
    assert r.returncode == 0, r.stderr
    local = tmp_path / "local"
    m = mount_factory(dest, local=local, env=WIDE)
    written = {"logs/a": b"log a\n", "deep/x/b": os.urandom(5000), "ok.txt": b"fine\n"}
    for rel, data in written.items():
        (m.path / rel).parent.mkdir(parents=True, exist_ok=True)
        (m.path / rel).write_bytes(data)
    r = run_cli("umount", m.template, "--stage-out", out, env=m.env, check=False)
    m.umount_result = r
    assert r.returncode == 1, r
    refused = [ln for ln in r.stderr.splitlines() if ln.startswith("not saved")]
    assert any(f"{out}/logs is a symlink (to {outside})" in ln for ln in refused), r.stderr
    assert any(f"{out}/deep/x is a symlink (to {outside2})" in ln for ln in refused), r.stderr
    assert f"written files kept in {local}" in r.stderr
    assert (out / "ok.txt").read_bytes() == written["ok.txt"]
    assert {d: _dir_state(d) for d in (outside, outside2)} == before
    assert not m.path.is_mount() and str(m.path) not in fuse_mounts()
    # recover refuses the same DIR, and saves everything into a clean one.
    r = run_cli("recover", local, "--stage-out", out, env=m.env, check=False)
    assert r.returncode == 1 and "is a symlink" in r.stderr, r
    assert {d: _dir_state(d) for d in (outside, outside2)} == before
    clean = tmp_path / "clean"
    run_cli("recover", local, "--stage-out", clean, env=m.env)
    assert {rel: (clean / rel).read_bytes() for rel in written} == written


# ------------------------------------------------------------------------------ unprivileged


def _in_namespace(u: User, binds: dict[str, Path], argv: list[str], env: dict[str, str],
                  then: str = "") -> subprocess.CompletedProcess[str]:
    """Run the CLI as `u` in a private mount namespace where each key of `binds` (/dev/fuse,
    /etc/fuse.conf) is replaced by a bind mount; `then` runs after it, as `u`, same namespace."""
    mounts = " && ".join(f"mount --bind {src} {dst}" for dst, src in binds.items())
    cli = " ".join(f"'{a}'" for a in [*USER_CLI, *argv])
    script = f"{mounts} && {' '.join(_setpriv(u))} {cli}; rc=$?; {then} exit $rc"
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                          env=env, capture_output=True, text=True, errors="replace", timeout=120,
                          stdin=subprocess.DEVNULL)


@pytest.mark.mount
@pytest.mark.timeout(240)
def test_unprivileged_mount_errors_name_cause_and_fix(pub: Path, other: User):
    """As the second user: /dev/fuse 0600 -> one line naming the mode and the fixes; once the
    device is 0666 (the fix) the same command mounts and serves; -o allow_other without
    user_allow_other -> one line naming fuse.conf; a state dir they cannot enter -> one line."""
    src = _tree(pub / "src", b"unprivileged", 0o644, 0o755)
    dest = pub / "dest"
    run_cli("prep", src, dest, "--mode", "0644", "--quiet")
    home = pub / "home"
    home.mkdir()
    os.chown(home, other.uid, other.gid)
    mp = home / "mp"
    assert as_user(other, "mkdir", mp, home / "tmp").returncode == 0
    ns = pub / "ns"
    ns.mkdir()
    for name, mode in (("fuse600", 0o600), ("fuse666", 0o666)):
        os.mknod(ns / name, 0o600 | stat.S_IFCHR, os.makedev(10, 229))
        os.chmod(ns / name, mode)
    (ns / "fuse.conf").write_text("# no user_allow_other here\n")
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    env.update(FANSTORE_STATE_DIR=str(home / "state"), TMPDIR=str(home / "tmp"), HOME=str(home),
               PYTHONPATH=USER_PYTHONPATH, **WIDE)
    conf = {"/etc/fuse.conf": ns / "fuse.conf"}
    try:
        r = _in_namespace(other, {"/dev/fuse": ns / "fuse600", **conf}, ["mount", dest, mp], env)
        line = _one_line(r)
        print(line)
        assert "/dev/fuse is mode 0600 (root:root)" in line and "fix:" in line, line
        assert "chgrp" in line and "prolog" in line, line
        r = _in_namespace(other, {"/dev/fuse": ns / "fuse666", **conf},
                          ["mount", dest, mp, "-o", "allow_other"], env)
        line = _one_line(r)
        print(line)
        assert "user_allow_other" in line and "fix:" in line, line
        # The fix works: with the device open to the user, the same mount serves the dataset.
        check = (f"{' '.join(USER_CLI)} status {mp} >/dev/null && cat {mp}/a.txt && "
                 f"{' '.join(USER_CLI)} umount {mp} >&2;")
        r = _in_namespace(other, {"/dev/fuse": ns / "fuse666", **conf}, ["mount", dest, mp], env,
                          then=f"{' '.join(_setpriv(other))} sh -c '{check}';")
        assert r.returncode == 0 and r.stdout == "a unprivileged\n", r
        assert "unmounted" in r.stderr, r.stderr
        # A state dir they cannot enter: one line (the check comes before /dev/fuse).
        locked = pub / "locked"
        locked.mkdir(mode=0o700)
        env2 = dict(env, FANSTORE_STATE_DIR=str(locked / "state"))
        for args in (["mount", dest, mp], ["umount", mp], ["status", mp]):
            line = _one_line(as_user(other, *USER_CLI, *args, env=env2))
            assert "state directory" in line and "Permission denied" in line, line
    finally:
        for pid in all_recorded_pids(home / "state"):  # a daemon left in its namespace
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert not any(p.name.endswith(".json") for p in (home / "state").iterdir())
    assert os.listdir(mp) == []
