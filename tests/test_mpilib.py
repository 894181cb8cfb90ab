"""Which launcher, flags and srun plugin fit the MPI library mpi4py uses (`_mpilib`), from the
library's own version string, and the one-line checks a rank makes before and after MPI_Init.
No MPI is started here (tests/test_cluster.py starts real ranks of either library)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from fanstore_fuse import _mpilib as m
from fanstore_fuse._errors import FanstoreError
from fanstore_fuse._settings import Settings
from fanstore_fuse._slurmjob import JobPlan, user_env

OPEN_MPI = ("Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4, May 26, "
            "2022")
MPICH = "MPICH Version:      5.0.2\nMPICH Release date: Fri Sep 25 20:45:26 UTC 2026\n"
CRAY = "CRAY MPICH version 8.1.27.26 (ANL base 3.4a2)\nMPICH Version:3.4a2\n"
INTEL = "Intel(R) MPI Library 2021.10 for Linux* OS\n"
MVAPICH = "MVAPICH2 Version      :\t2.3.7\nMVAPICH2 Release date :\tWed March 02 22:00:00 EST 2022\n"

HYDRA_VERSION = "HYDRA build details:\n    Version:                                 4.2.0\n"
OMPI_VERSION = "mpiexec (OpenRTE) 4.1.4\n\nReport bugs to http://www.open-mpi.org/community/help/\n"
OMPI5_VERSION = "mpiexec (Open MPI) 5.0.3\n\nReport bugs to https://www.open-mpi.org/community/help/\n"

SRUN_LIST = ("MPI plugin types are...\n\tcray_shasta\n\tnone\n\tpmi2\n\tpmix\n"
             "specific pmix plugin versions available: pmix_v4\n")


@pytest.mark.parametrize(("version", "family", "cray"), [
    (OPEN_MPI, m.OPEN_MPI, False), (MPICH, m.MPICH, False), (CRAY, m.MPICH, True),
    (INTEL, m.MPICH, False), (MVAPICH, m.MPICH, False), ("Microsoft MPI 10.1", m.OTHER, False),
])
def test_family_from_the_library_version(version, family, cray):
    lib = m.Library(version)
    assert (lib.family, lib.cray) == (family, cray)
    assert "\n" not in lib.name and lib.name


def test_names_are_short():
    assert m.Library(OPEN_MPI).name == "Open MPI v4.1.4"
    assert m.Library(MPICH).name == "MPICH 5.0.2"
    assert m.Library(CRAY).name == "CRAY MPICH 8.1.27.26 (ANL base 3.4a2)"
    assert m.Library(MVAPICH).name == "MVAPICH2 2.3.7"


@pytest.mark.parametrize(("text", "kind"), [
    (HYDRA_VERSION, m.HYDRA), (OMPI_VERSION, m.OPEN_MPI), (OMPI5_VERSION, m.OPEN_MPI),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619", m.HYDRA),
    ("mpiexec version 1.2.12", m.OTHER),
])
def test_launcher_kind_from_its_version(text, kind):
    assert m.launcher_kind(text) == kind


def test_hydra_flags_only_for_hydra():
    hydra = m.mpiexec_command(m.Mpiexec(["/x/mpiexec"], m.HYDRA), 3)
    assert hydra == ["/x/mpiexec", "-n", "3", "-disable-auto-cleanup"]
    joined = m.mpiexec_command(m.Mpiexec(["/x/mpiexec"], m.HYDRA), 1, joined=True)
    assert joined[-4:] == ["-launcher", "fork", "-rmk", "user"]
    ompi = m.mpiexec_command(m.Mpiexec(["/usr/bin/mpiexec"], m.OPEN_MPI), 3)
    assert ompi[:3] == ["/usr/bin/mpiexec", "-n", "3"] and "--oversubscribe" in ompi
    assert ("--allow-run-as-root" in ompi) == (os.geteuid() == 0)
    assert not [a for a in ompi if a in ("-disable-auto-cleanup", "-launcher", "-rmk")]
    other = m.mpiexec_command(m.Mpiexec(["mpiexec", "--label"], m.OTHER), 2)
    assert other == ["mpiexec", "--label", "-n", "2"]


@pytest.mark.parametrize(("version", "listing", "plugin"), [
    (OPEN_MPI, SRUN_LIST, "pmix"),
    (OPEN_MPI, "MPI plugin types are...\n\tnone\n\tpmi2\nspecific pmix plugin versions "
               "available: pmix_v4\n", "pmix_v4"),
    (OPEN_MPI, "", "pmix"),  # no listing (no srun): the first preference
    (MPICH, SRUN_LIST, "pmi2"), (INTEL, SRUN_LIST, "pmi2"), (MVAPICH, SRUN_LIST, "pmi2"),
    (CRAY, SRUN_LIST, "cray_shasta"),
    (CRAY, "MPI plugin types are...\n\tnone\n\tpmi2\n", "pmi2"),
])
def test_srun_plugin_from_the_library(version, listing, plugin):
    assert m.srun_plugin(m.Library(version), "", listing) == plugin


def test_srun_plugin_override_wins():
    assert m.srun_plugin(m.Library(OPEN_MPI), "pmix_v3", SRUN_LIST) == "pmix_v3"


SRUN_STEP = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "3"}


def test_open_mpi_under_srun_pmi2_fails_before_init_naming_the_fix():
    env = {**SRUN_STEP, "SLURM_MPI_TYPE": "pmi2", "PMI_FD": "5", "PMI_RANK": "0", "PMI_SIZE": "3"}
    why = m.start_problem(m.Library(OPEN_MPI), env)
    assert "Open MPI v4.1.4 needs PMIx to start 3 ranks" in why
    assert "srun --mpi=pmi2" in why and "FANSTORE_SRUN_MPI=pmix" in why
    assert "\n" not in why


def test_open_mpi_under_srun_pmix_is_fine():
    env = {**SRUN_STEP, "SLURM_MPI_TYPE": "pmix", "PMIX_NAMESPACE": "slurm.pmix.7.0",
           "PMIX_RANK": "1", "PMIX_SERVER_URI41": "pmix-server.1;tcp4://127.0.0.1:1"}
    assert m.start_problem(m.Library(OPEN_MPI), env) == ""


def test_open_mpi_under_hydra_fails_naming_fanstore_mpiexec():
    env = {"PMI_FD": "6", "PMI_RANK": "2", "PMI_SIZE": "3"}
    why = m.start_problem(m.Library(OPEN_MPI), env, world=3)
    assert "hydra" in why and "FANSTORE_MPIEXEC" in why


def test_mpich_under_srun_none_fails_naming_pmi2():
    why = m.start_problem(m.Library(MPICH), {**SRUN_STEP, "SLURM_MPI_TYPE": "none"})
    assert "MPICH 5.0.2 needs PMI" in why and "FANSTORE_SRUN_MPI=pmi2" in why


def test_the_mpich_wheel_under_open_mpis_mpiexec_fails_before_init():
    env = {"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_RANK": "0", "PMIX_NAMESPACE": "x",
           "PMIX_RANK": "0"}
    why = m.start_problem(m.Library(MPICH), env, world=3)
    assert "needs PMI to start 3 ranks together, but Open MPI's mpiexec gave it none" in why
    assert "FANSTORE_MPIEXEC" in why
    pmix_mpich = m.Library(MPICH + "MPICH configure:    --with-pmix=/usr --with-pm=no\n")
    assert m.start_problem(pmix_mpich, {**SRUN_STEP, "PMIX_NAMESPACE": "x", "PMIX_RANK": "0"}) == ""
    wheel_under_pmix = {**SRUN_STEP, "SLURM_MPI_TYPE": "pmix", "PMIX_NAMESPACE": "x"}
    assert "FANSTORE_SRUN_MPI=pmi2" in m.start_problem(m.Library(MPICH), wheel_under_pmix)


@pytest.mark.parametrize("env", [
    {**SRUN_STEP, "PMI_FD": "5", "PMI_RANK": "0"},  # srun --mpi=pmi2
    {"PMI_FD": "6", "PMI_RANK": "0", "PMI_SIZE": "3"},  # hydra
    {},  # one rank, nothing to meet
    {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1"},
])
def test_mpich_with_its_process_manager_is_fine(env):
    assert m.start_problem(m.Library(MPICH), env) == ""


def test_a_smaller_world_than_was_started_is_one_line():
    env = {"PMI_FD": "6", "PMI_RANK": "0", "PMI_SIZE": "3"}
    why = m.world_problem(m.Library(OPEN_MPI), env, size=1, world=3)
    assert why.startswith("MPI sees a world of 1 rank(s) but 3 were started")
    assert "FANSTORE_MPIEXEC" in why
    step = m.world_problem(m.Library(OPEN_MPI), {**SRUN_STEP, "SLURM_MPI_TYPE": "pmi2"}, 1)
    assert "but 3 were started: srun --mpi=pmi2" in step and "FANSTORE_SRUN_MPI=pmix" in step
    assert m.world_problem(m.Library(MPICH), env, size=3, world=3) == ""
    assert m.world_problem(m.Library(MPICH), {}, size=1) == ""  # no launcher: a mount of one


def _fake(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    assert "'" not in text
    path.write_text(f"#!/bin/sh\nprintf '%s' '{text}'\n")  # a builtin: PATH may lack /bin
    path.chmod(0o755)
    return path


def test_the_mpiexec_next_to_the_library_wins_over_path(tmp_path, monkeypatch):
    ompi = _fake(tmp_path / "ompi" / "bin" / "mpiexec", OMPI_VERSION)
    _fake(tmp_path / "ompi" / "bin" / "mpicc", "")
    _fake(tmp_path / "path" / "mpiexec", HYDRA_VERSION)
    monkeypatch.setenv("PATH", f"{tmp_path / 'path'}:/usr/bin:/bin")
    lib = m.Library(OPEN_MPI, str(tmp_path / "ompi" / "bin" / "mpicc"))
    exe = m.mpiexec(lib)
    assert exe == m.Mpiexec([str(ompi)], m.OPEN_MPI)


def test_an_mpiexec_of_another_library_is_skipped(tmp_path, monkeypatch):
    _fake(tmp_path / "ompi" / "bin" / "mpiexec", OMPI_VERSION)
    _fake(tmp_path / "ompi" / "bin" / "mpicc", "")
    _fake(tmp_path / "path" / "mpiexec", HYDRA_VERSION)
    monkeypatch.setenv("PATH", str(tmp_path / "path"))
    lib = m.Library(MPICH, str(tmp_path / "ompi" / "bin" / "mpicc"))
    exe = m.mpiexec(lib)
    assert exe.kind == m.HYDRA  # this venv's (the mpich wheel) or the one on PATH


def test_no_mpiexec_of_the_library_is_one_line(tmp_path, monkeypatch):
    _fake(tmp_path / "h" / "mpiexec", HYDRA_VERSION)
    _fake(tmp_path / "h" / "mpicc", "")
    monkeypatch.setenv("PATH", str(tmp_path / "h"))
    if any(os.path.exists(os.path.join(os.path.dirname(sys.executable), n))
           for n in ("mpiexec", "mpirun", "mpiexec.openmpi")):
        pytest.skip("this Python's bin has an mpiexec of its own")  # never Open MPI's here
    with pytest.raises(FanstoreError, match="no mpiexec of Open MPI v4.1.4 found .*FANSTORE_MPIEXEC"):
        m.mpiexec(m.Library(OPEN_MPI, str(tmp_path / "h" / "mpicc")))


def test_fanstore_mpiexec_overrides(tmp_path):
    fake = _fake(tmp_path / "site" / "mpirun", OMPI5_VERSION)
    exe = m.mpiexec(m.Library(MPICH), f"{fake} --mca btl tcp,self")
    assert exe == m.Mpiexec([str(fake), "--mca", "btl", "tcp,self"], m.OPEN_MPI)
    with pytest.raises(FanstoreError, match="FANSTORE_MPIEXEC="):
        m.mpiexec(m.Library(MPICH), str(tmp_path / "missing"))


def test_prolog_mode_needs_mpich_family_or_an_ompi_server(tmp_path):
    assert m.join_problem(m.Library(MPICH)) == ""
    with_server = _fake(tmp_path / "ompi4" / "mpiexec", OMPI_VERSION)
    _fake(tmp_path / "ompi4" / "ompi-server", "")
    assert m.join_problem(m.Library(OPEN_MPI), m.Mpiexec([str(with_server)], m.OPEN_MPI)) == ""
    alone = _fake(tmp_path / "ompi5" / "mpiexec", OMPI5_VERSION)
    why = m.join_problem(m.Library(OPEN_MPI), m.Mpiexec([str(alone)], m.OPEN_MPI))
    assert "prolog mode (--join) needs an MPICH-family MPI or Open MPI's ompi-server" in why
    assert "Microsoft MPI" in m.join_problem(m.Library("Microsoft MPI 10.1"))


def test_joined_open_mpi_ranks_stay_on_this_node_and_meet_through_the_server():
    cmd = m.mpiexec_command(m.Mpiexec(["/usr/bin/mpiexec"], m.OPEN_MPI), 1, joined=True,
                            server_uri="/shared/rv/ompi-server.uri")
    assert cmd[-2:] == ["--ompi-server", "file:/shared/rv/ompi-server.uri"]
    assert "isolated" in cmd and "^slurm" in cmd


def test_stop_ompi_server_checks_the_pid_first(tmp_path):
    (tmp_path / m.OMPI_PID).write_text(f"{os.getpid()}\n")  # this pytest: not an ompi-server
    assert m.stop_ompi_server(str(tmp_path)) is False
    (tmp_path / m.OMPI_PID).write_text("garbage\n")
    assert m.stop_ompi_server(str(tmp_path)) is False


def test_settings_carry_the_launcher_overrides():
    s = Settings.from_env({"FANSTORE_MPIEXEC": "/opt/ompi/bin/mpiexec", "FANSTORE_SRUN_MPI": "pmix"})
    assert (s.mpiexec, s.srun_mpi) == ("/opt/ompi/bin/mpiexec", "pmix")
    assert (Settings.from_env({}).mpiexec, Settings.from_env({}).srun_mpi) == ("", "")


def test_library_in_use_is_known():
    lib = m.library()  # asked in a child process: this one keeps MPI uninitialised
    assert lib.family in (m.MPICH, m.OPEN_MPI)
    assert lib.version.splitlines()[0] in lib.version


def test_the_prolog_passes_the_sites_mpi_environment():
    plan = JobPlan("1", "nobody", 65534, 65534, "/d", "/m", "/l", "/r", 0, 1, state_dir="/s")
    site = {"OMPI_MCA_btl": "tcp,self", "PMIX_MCA_gds": "hash", "OMPI_ALLOW_RUN_AS_ROOT": "1",
            "I_MPI_FABRICS": "shm:ofi", "MV2_USE_CUDA": "0", "MPICH_OFI_NIC_POLICY": "NUMA",
            "HYDRA_LAUNCHER": "fork", "UCX_TLS": "tcp,self", "FI_PROVIDER": "tcp",
            "MPIR_CVAR_CH4_NETMOD": "ofi", "FANSTORE_MPIEXEC": "/opt/bin/mpiexec",
            "FANSTORE_SRUN_MPI": "pmix", "LD_PRELOAD": "/x.so",
            "SECRET_TOKEN": "x", "SLURM_JOB_ID": "1"}
    env = user_env(plan, site)
    for k in site:
        if k in ("LD_PRELOAD", "SECRET_TOKEN", "SLURM_JOB_ID"):
            assert k not in env
        else:
            assert env[k] == site[k], k
    assert env["FANSTORE_STATE_DIR"] == "/s" and env["USER"] == "nobody"
