# fanstore-fuse: every target installs what it needs on a fresh machine.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
# mpich: MPI as a wheel (its mpiexec goes into the venv). A cluster install leaves it out and
# builds mpi4py against the site's MPI instead (README; `make test-openmpi` does that here).
EXTRAS ?= test,bench,tensor,mpich

.PHONY: all deps venv install demo test test-sanitize test-openmpi test-fast lint bench bench-quick bench-metadata bench-cost bench-epoch2 clean pjdfstest

all: test

# Debian packages: fuse3 (fusermount3), libfuse3-dev + pkg-config (pyfuse3 builds from source),
# squashfs-tools + squashfuse (benchmark anchors); as root also slurm-wlm + munge (the `slurm`
# tests' one-machine cluster, scripts/minicluster/).
SLURM_DEPS := $(shell [ "$$(id -u)" = 0 ] && echo --slurm)
deps:
	@bash scripts/install-deps.sh $(SLURM_DEPS)

PYFUSE3_PATCH := scripts/install-pyfuse3.sh scripts/pyfuse3/pyfuse3-3.5.0-public-api.patch

$(STAMP): pyproject.toml scripts/install-deps.sh $(PYFUSE3_PATCH)
	@bash scripts/install-deps.sh $(SLURM_DEPS)
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip wheel
	$(PIP) install --quiet -e '.[$(EXTRAS)]'
	@# pyfuse3 3.5.0 rebuilt with the public API fanstore-fuse uses when present
	@# (scripts/pyfuse3/README.md); skipped when already installed.
	bash scripts/install-pyfuse3.sh $(PY)
	@# An editable install compiles nothing; with PYTHONDONTWRITEBYTECODE set every daemon would
	@# then compile the package at start (~0.4 CPU s of its start-up, measured).
	$(PY) -m compileall -q src >/dev/null
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider --durations=20

# Native code under the sanitizers (issue 49): fails if C/C++/Cython appears under src/, then
# builds the patched pyfuse3 with -Werror and ASan+UBSan into a throwaway venv
# (/tmp/fanstore-sanitize-venv) and runs tests/test_pyfuse3_api.py and pyfuse3's own tests on it;
# any sanitizer report fails (scripts/test-sanitize.sh). About a minute.
test-sanitize: $(STAMP)
	bash scripts/test-sanitize.sh python3

# The multi-rank tests again with Debian's Open MPI instead of the mpich wheel: a second venv
# ($(OMPI_VENV), no mpich extra) with mpi4py built from source against Open MPI, once; the built
# wheel is kept in ~/.cache/fanstore-fuse (scripts/openmpi-venv.sh). Then the tests that start
# real ranks through `mount --ranks`, the launcher checks, prolog mode's join (ompi-server), and
# (as root) the Slurm job-script and prolog flows on the one-machine cluster (written hard
# links, symlinks, xattrs and a log read across nodes among them), and remote reads
# (tests/test_remote.py: the same Python code as under MPICH).
OMPI_VENV ?= .venv-ompi
OMPI_STAMP := $(OMPI_VENV)/.installed
OMPI_TESTS ?= tests/test_mpilib.py tests/test_mpi_launch.py tests/test_cluster.py tests/test_remote.py \
  tests/test_transport.py tests/test_slurm.py tests/test_rendezvous.py tests/test_slurm_prolog.py \
  tests/cluster/test_site_mpi.py tests/cluster/test_prolog.py \
  tests/cluster/test_jobscript.py::test_job_script_mounts_on_every_node_and_leaves_nothing \
  tests/cluster/test_jobscript.py::test_ranks_that_do_not_meet_fail_with_one_clear_line \
  tests/cluster/test_links_cluster.py
$(OMPI_STAMP): pyproject.toml scripts/openmpi-venv.sh $(PYFUSE3_PATCH)
	@bash scripts/install-deps.sh $(SLURM_DEPS)
	bash scripts/openmpi-venv.sh $(OMPI_VENV) test
	bash scripts/install-pyfuse3.sh $(OMPI_VENV)/bin/python
	$(OMPI_VENV)/bin/python -m compileall -q src >/dev/null
	@touch $(OMPI_STAMP)

test-openmpi: $(OMPI_STAMP)
	$(OMPI_VENV)/bin/python -m pytest -q -p no:cacheprovider --durations=10 $(OMPI_TESTS)

# POSIX conformance of a written directory (issue 13): ok / planned per directory, and the bar
# (>= 95% ok). Root, /dev/fuse, autotools (installed with apt when missing). About 10 min.
PJD_JSON ?= /tmp/fanstore-pjdfstest.json
pjdfstest: $(STAMP)
	$(PY) scripts/pjdfstest.py --json $(PJD_JSON)
	$(PY) -c "import json,sys; t=json.load(open('$(PJD_JSON)'))['total']; \
	  print(f\"{t['ok']}/{t['planned']} ok\"); sys.exit(t['ok'] < 0.95 * t['planned'])"

# In process only: no FUSE mount, no MPI ranks (runs where /dev/fuse is missing).
test-fast: $(STAMP)
	$(PY) -m pytest -q -x -p no:cacheprovider -m "not mount and not mpi and not fault and not slurm"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench scripts
	$(VENV)/bin/mypy

# Benches run with this VM's free page reporting held back, after 6 GiB of memory are written
# once so that the host backs them (bench/calm.py: VM steps that make runs of every system
# sporadically 3-4x slower; a no-op elsewhere). `make bench-quick CALM=` runs them without.
CALM ?= $(PY) -m bench.calm
bench: $(STAMP)
	$(CALM) $(PY) -m bench.run --full
	$(CALM) $(PY) -m bench.fio --full

bench-quick: $(STAMP)
	$(CALM) $(PY) -m bench.run --quick
	$(CALM) $(PY) -m bench.metadata_scale --files 2000 --files 10000
	$(CALM) $(PY) -m bench.cost
	$(CALM) $(PY) -m bench.smallfile --rounds 3 --anchors squashfuse_ll,ratarmount,nullfs,ext4,fanstore-copy-cached
	$(CALM) $(PY) -m bench.epoch2
	$(CALM) $(PY) -m bench.fio --quick --files rand --systems ext4,squashfuse,fanstore1

# Metadata scale (issue 14): tiny-file trees; FILES="20000 128117" or up to 1281167 (minutes).
FILES ?= 20000 128117
bench-metadata: $(STAMP)
	$(PY) -m bench.metadata_scale $(foreach n,$(FILES),--files $(n)) --out /tmp/fanstore-metadata-bench/results.json

# CPU per file read (local, remote), latency, writable vs --read-only, squashfuse(_ll): issue 11
bench-cost: $(STAMP)
	$(PY) -m bench.cost

# Second epoch over 2 ranks from the disk cache vs 1 rank all local: issue 11 part 3
bench-epoch2: $(STAMP)
	$(PY) -m bench.epoch2

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
