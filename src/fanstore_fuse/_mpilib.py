"""The MPI library mpi4py uses, and how ranks of it are started and checked.

fanstore-fuse works with the MPI that mpi4py was built against (the `mpich` wheel, or a site's
MPI with `MPICC=mpicc pip install --no-binary mpi4py mpi4py`). From the library's own name
(`MPI.Get_library_version()`, which needs no `MPI_Init`) follow:

- the `mpiexec` of `mount --ranks N`: `FANSTORE_MPIEXEC`, else the first `mpiexec` whose
  `--version` belongs to the library, looked for in the library's install (the `bin` beside
  the libmpi that mpi4py's extension is linked against), then in this Python's `bin` (the
  `mpich` wheel puts its own there), then on PATH;
- its flags: hydra's (MPICH, MVAPICH, Intel MPI) `-disable-auto-cleanup`, and for a daemon
  that joins others in a Slurm prolog `-launcher fork -rmk user`; Open MPI's
  `--oversubscribe` and, as root, `--allow-run-as-root`; none for any other launcher;
- the `srun --mpi` plugin inside a Slurm job: pmix for Open MPI, cray_shasta for Cray MPICH,
  pmi2 for the rest of the MPICH family (`FANSTORE_SRUN_MPI` sets another);
- before `MPI_Init` each daemon compares what launched it (the PMI or PMIx variables srun and
  mpiexec set) with the library, and fails with one line naming the fix: a library started
  without its process manager would come up as N worlds of one rank each (`start_problem`).
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from ._errors import FanstoreError

OPEN_MPI = "openmpi"
MPICH = "mpich"  # MPICH and the libraries built on it: Cray MPICH, Intel MPI, MVAPICH
OTHER = "other"

# The launcher kinds an `mpiexec --version` reveals.
HYDRA = "hydra"


@dataclass(frozen=True)
class Library:
    """One MPI library, from the text of `MPI.Get_library_version()`."""

    version: str
    mpicc: str = ""  # the compiler wrapper mpi4py was built with, where mpi4py says ("" mostly)
    libmpi: str = ""  # the libmpi mpi4py's extension is linked against ("" for a binary wheel)

    @property
    def name(self) -> str:
        """Its first line, shortened: "Open MPI v4.1.4", "MPICH 5.0.2" (of "MPICH Version: 5.0.2")."""
        first = self.version.strip().splitlines()[0] if self.version.strip() else "unknown MPI"
        first = " ".join(first.split()).split(", package:")[0]
        first = re.sub(r"^(.*?) [Vv]ersion ?:? ", r"\1 ", first)
        return first[:80]

    @property
    def family(self) -> str:
        return family_of(self.version)

    @property
    def cray(self) -> bool:
        return self.version.lstrip().upper().startswith("CRAY MPICH")


def family_of(version: str) -> str:
    v = version.lstrip()
    if v.startswith("Open MPI"):
        return OPEN_MPI
    if any(s in v.upper() for s in ("MPICH", "MVAPICH")) or "Intel(R) MPI" in v:
        return MPICH
    return OTHER


_PROBE = ("from mpi4py import rc\nrc.initialize = rc.finalize = False\nimport mpi4py\n"
          "from mpi4py import MPI\nprint(mpi4py.get_config().get('mpicc', ''))\n"
          "print(MPI.__file__)\nprint(MPI.Get_library_version())\n")


def linked_libmpi(extension: str) -> str:
    """The libmpi an extension module is linked against, as the dynamic loader resolves it
    (`ldd`); "" when it is loaded at run time instead (mpi4py's binary wheels) or not found."""
    try:
        r = subprocess.run(["ldd", extension], capture_output=True, text=True, timeout=30,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return ""
    for line in r.stdout.splitlines():
        name, _, where = line.strip().partition(" => ")
        if name.startswith("libmpi.so") and where.startswith("/"):
            return where.split(" (")[0]
    return ""


@functools.lru_cache(maxsize=1)
def library() -> Library:
    """The library mpi4py loads, asked in a short child process: `MPI_Init` never runs, and this
    process keeps mpi4py's settings untouched for whoever initialises MPI in it later."""
    try:
        r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                           timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as e:
        raise FanstoreError(f"cannot ask mpi4py for its MPI library: {e}") from None
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise FanstoreError(f"mpi4py cannot load an MPI library: {last} (install mpi4py built "
                            "against the site's MPI, or the `mpich` extra)")
    mpicc, extension, version = r.stdout.split("\n", 2)
    return Library(version.strip(), mpicc.strip(), linked_libmpi(extension.strip()))


# ---------------------------------------------------------------- mpiexec


def launcher_kind(version_text: str) -> str:
    """What an `mpiexec --version` printed: Open MPI's, hydra (MPICH, MVAPICH, Intel MPI), other."""
    if "Open MPI" in version_text or "OpenRTE" in version_text:
        return OPEN_MPI
    if "HYDRA" in version_text or "Intel(R) MPI" in version_text:
        return HYDRA
    return OTHER


def matches(lib_family: str, kind: str) -> bool:
    """May an `mpiexec` of this kind start ranks of this library?"""
    if lib_family == OPEN_MPI:
        return kind == OPEN_MPI
    if lib_family == MPICH:
        return kind in (HYDRA, OTHER)  # OTHER: e.g. Cray's PALS mpiexec
    return True


def _version_of(cmd: list[str]) -> str | None:
    try:
        r = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=30,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout + r.stderr


def _install_bins(libmpi: str) -> list[str]:
    """`bin` directories of the install a libmpi belongs to: the first `bin` beside one of the
    library directory's parents (/opt/openmpi/lib -> /opt/openmpi/bin, /usr/lib/x86_64-linux-gnu
    -> /usr/bin)."""
    d = os.path.dirname(os.path.realpath(libmpi))
    for _ in range(3):
        d = os.path.dirname(d)
        if os.path.isdir(os.path.join(d, "bin")):
            return [os.path.join(d, "bin")]
    return []


def _candidates(lib: Library) -> list[str]:
    """Where an `mpiexec` of `lib` may be, most likely first: beside the `mpicc` mpi4py was
    built with (when mpi4py records it), in the library's install, in this Python's `bin`, on
    PATH."""
    dirs: list[str] = []
    if lib.mpicc:
        cc = lib.mpicc.split()[0]
        cc = cc if os.path.isabs(cc) else (shutil.which(cc) or "")
        if cc:
            dirs.append(os.path.dirname(cc))
    if lib.libmpi:
        dirs += _install_bins(lib.libmpi)
    dirs.append(os.path.dirname(sys.executable))
    names = ("mpiexec", "mpirun", "mpiexec.openmpi") if lib.family == OPEN_MPI else (
        "mpiexec", "mpiexec.hydra", "mpiexec.mpich", "mpirun")
    out: list[str] = []
    for d in dirs:
        out += [os.path.join(d, n) for n in names]
    for n in names:
        if found := shutil.which(n):
            out.append(found)
    return [p for p in dict.fromkeys(out) if os.access(p, os.X_OK)]


@dataclass(frozen=True)
class Mpiexec:
    cmd: list[str]  # the program and any arguments FANSTORE_MPIEXEC gave
    kind: str


@functools.lru_cache(maxsize=4)
def _find_mpiexec(lib: Library, override: str) -> Mpiexec:
    if override:
        cmd = shlex.split(override)
        text = _version_of(cmd)
        if text is None:
            raise FanstoreError(f"FANSTORE_MPIEXEC={override!r} does not run")
        return Mpiexec(cmd, launcher_kind(text))
    tried: list[str] = []
    fallback: Mpiexec | None = None
    for path in _candidates(lib):
        text = _version_of([path])
        if text is None:
            continue
        kind = launcher_kind(text)
        tried.append(f"{path} ({kind})")
        if matches(lib.family, kind):
            if kind != OTHER or lib.family == OTHER:
                return Mpiexec([path], kind)
            fallback = fallback or Mpiexec([path], kind)
    if fallback is not None:
        return fallback
    raise FanstoreError(f"no mpiexec of {lib.name} found (tried {', '.join(tried) or 'none'}): "
                        "set FANSTORE_MPIEXEC to the mpiexec of the MPI mpi4py was built with")


def mpiexec(lib: Library, override: str = "") -> Mpiexec:
    return _find_mpiexec(lib, override)


def mpiexec_command(exe: Mpiexec, ranks: int, joined: bool = False, server_uri: str = "") -> list[str]:
    """`mpiexec -n N` and the flags its kind needs (`server_uri`: the `ompi-server` through
    which Open MPI daemons of separate runs join)."""
    cmd = [*exe.cmd, "-n", str(ranks)]
    if exe.kind == HYDRA:
        # Without auto-cleanup, one rank dying does not take the others down: they keep
        # serving from replicas and the source.
        cmd.append("-disable-auto-cleanup")
        if joined:
            # In a Slurm prolog hydra would otherwise see the job's environment and launch with
            # srun on the job's first node; this daemon belongs on this node.
            cmd += ["-launcher", "fork", "-rmk", "user"]
    elif exe.kind == OPEN_MPI:
        cmd.append("--oversubscribe")  # more ranks than cores: `--ranks` stands in for nodes
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        if joined:
            # this node only, whatever Slurm variables the environment holds
            cmd += ["--mca", "plm", "isolated", "--mca", "ras", "^slurm"]
            if server_uri:
                cmd += ["--ompi-server", f"file:{server_uri}"]
    return cmd


OMPI_URI = "ompi-server.uri"
OMPI_PID = "ompi-server.pid"


def ompi_server(exe: Mpiexec) -> str:
    """Open MPI's `ompi-server` beside its `mpiexec` ("" when there is none: Open MPI 5 has
    none)."""
    path = os.path.join(os.path.dirname(os.path.realpath(exe.cmd[0])), "ompi-server")
    return path if os.access(path, os.X_OK) else ""


def join_problem(lib: Library, exe: Mpiexec | None = None) -> str:
    """Prolog mode joins daemons of separate `mpiexec` runs (`_rendezvous`). MPICH's family does
    that by itself; Open MPI through an `ompi-server` that node 0 starts (`_launch`)."""
    if lib.family == MPICH or (lib.family == OPEN_MPI and exe is not None and ompi_server(exe)):
        return ""
    why = "Open MPI without an ompi-server beside its mpiexec" if lib.family == OPEN_MPI else lib.name
    return (f"prolog mode (--join) needs an MPICH-family MPI or Open MPI's ompi-server, but "
            f"mpi4py uses {why}: mount from the job script instead (docs/slurm.md)")


def stop_ompi_server(directory: str) -> bool:
    """SIGTERM the `ompi-server` node 0 started for the meeting dir `directory`, if it still
    runs (its pid is checked against its command line first). True when one was stopped."""
    import signal

    try:
        with open(os.path.join(directory, OMPI_PID)) as f:
            pid = int(f.read().strip())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().split(b"\0")
    except (OSError, ValueError):
        return False
    uri = os.fsencode(os.path.join(directory, OMPI_URI))
    if not cmdline or not cmdline[0].endswith(b"ompi-server") or uri not in cmdline:
        return False
    try:
        os.kill(pid, signal.SIGTERM)
    except OSError:
        return False
    return True


# ---------------------------------------------------------------- srun


def srun_preferences(lib: Library) -> tuple[str, ...]:
    if lib.family == OPEN_MPI:
        return ("pmix", "pmix_v5", "pmix_v4", "pmix_v3", "pmix_v2")
    if lib.cray:
        return ("cray_shasta", "pmi2")
    return ("pmi2",)


def srun_plugins(text: str) -> set[str]:
    """Plugin names in the output of `srun --mpi=list`: one per line, and the versions after
    "available:" (`specific pmix plugin versions available: pmix_v4`)."""
    names: set[str] = set()
    for line in text.splitlines():
        line = line.strip()
        if re.fullmatch(r"[a-z][a-z0-9_]*", line):
            names.add(line)
        elif "available:" in line:
            names |= set(re.findall(r"[a-z][a-z0-9_]*", line.partition("available:")[2]))
    return names


def _srun_list() -> str:
    try:
        r = subprocess.run(["srun", "--mpi=list"], capture_output=True, text=True, timeout=10,
                           stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return ""
    return r.stdout + r.stderr if r.returncode == 0 else ""


def srun_plugin(lib: Library, override: str = "", listing: str | None = None) -> str:
    """The `srun --mpi` plugin for this library: the override, else the first of its plugins
    that this srun has (`srun --mpi=list`), else the first it prefers."""
    if override:
        return override
    prefs = srun_preferences(lib)
    have = srun_plugins(_srun_list() if listing is None else listing)
    return next((p for p in prefs if p in have), prefs[0])


# ---------------------------------------------------------------- before MPI_Init


def _has_pmix(env: Mapping[str, str]) -> bool:
    return "PMIX_NAMESPACE" in env or "PMIX_RANK" in env or any(
        k.startswith("PMIX_SERVER_URI") for k in env)


def _has_pmi(env: Mapping[str, str]) -> bool:
    return any(k in env for k in ("PMI_FD", "PMI_PORT", "PMI_RANK", "PMI_CONTROL_PORT"))


def launched_size(env: Mapping[str, str], world: int = 0) -> int:
    """How many ranks were started together, as far as this process can tell: the `--world`
    its launcher passed, else what srun or mpiexec put in the environment (0: unknown)."""
    if world:
        return world
    for key in ("SLURM_STEP_NUM_TASKS", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        v = env.get(key, "")
        if key == "SLURM_STEP_NUM_TASKS" and not env.get("SLURM_STEP_ID"):
            continue
        if v.isdigit():
            return int(v)
    return 0


def _how(env: Mapping[str, str]) -> str:
    if env.get("SLURM_STEP_ID"):
        kind = env.get("SLURM_MPI_TYPE")
        return f"srun --mpi={kind}" if kind else "srun with the cluster's MpiDefault plugin"
    if _has_pmi(env):
        return "a hydra mpiexec (MPICH's)"
    if "OMPI_COMM_WORLD_SIZE" in env:
        return "Open MPI's mpiexec"
    return "a launcher without a process manager"


def _fix(lib: Library, env: Mapping[str, str]) -> str:
    if env.get("SLURM_STEP_ID"):
        want = srun_preferences(lib)[0]
        return f"set FANSTORE_SRUN_MPI={want} (`srun --mpi=list` shows what this cluster has)"
    return f"set FANSTORE_MPIEXEC to the mpiexec of {lib.name}"


def speaks_pmix(lib: Library) -> bool:
    """Open MPI does; an MPICH built with PMIx says so in its configure line (the `mpich` wheel
    is not: "Runtime environment uses unsupported PMI version PMIx"); Intel MPI can be told to."""
    return lib.family != MPICH or "pmix" in lib.version.lower() or "Intel(R) MPI" in lib.version


def start_problem(lib: Library, env: Mapping[str, str], world: int = 0) -> str:
    """One line when this rank, started as one of several, cannot meet the others: its library
    finds no process manager it speaks in `env` (checked before `MPI_Init`, which would abort or
    come up alone). "" when nothing is wrong as far as the environment tells."""
    n = launched_size(env, world)
    if n <= 1:
        return ""
    if lib.family == OPEN_MPI and not _has_pmix(env):
        return (f"{lib.name} needs PMIx to start {n} ranks together, but {_how(env)} gave it "
                f"none: {_fix(lib, env)}")
    if lib.family == MPICH and not (_has_pmi(env) or (_has_pmix(env) and speaks_pmix(lib))) and (
            env.get("SLURM_STEP_ID") or "OMPI_COMM_WORLD_SIZE" in env):
        return (f"{lib.name} needs PMI to start {n} ranks together, but {_how(env)} gave it "
                f"none it speaks: {_fix(lib, env)}")
    return ""


def world_problem(lib: Library, env: Mapping[str, str], size: int, world: int = 0) -> str:
    """After `MPI_Init`: one line when the world is smaller than the ranks that were started
    (each would otherwise serve the whole dataset alone as rank 0)."""
    n = launched_size(env, world)
    if n <= size:
        return ""
    return (f"MPI sees a world of {size} rank(s) but {n} were started: {_how(env)} does not "
            f"start ranks of {lib.name}; {_fix(lib, env)}")
