#!/usr/bin/env bash
# A venv of fanstore-fuse as a cluster user of Open MPI would install it (`make test-openmpi`):
# Debian's Open MPI (openmpi-bin libopenmpi-dev, installed when missing and we are root), mpi4py
# built from source against it, then the package without the `mpich` extra.
#   openmpi-venv.sh VENV [EXTRAS]
# The mpi4py wheel is built once per Open MPI and Python version and kept in
# ${FANSTORE_WHEEL_CACHE:-~/.cache/fanstore-fuse}/mpi4py-openmpi-VERSION-PY/ (a build takes
# minutes); later runs install it from there.
set -euo pipefail
venv=${1:?usage: openmpi-venv.sh VENV [EXTRAS]}
extras=${2:-test}
if ! command -v mpicc.openmpi >/dev/null 2>&1 || ! command -v mpiexec.openmpi >/dev/null 2>&1; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "fanstore-fuse: Open MPI missing: apt-get install openmpi-bin libopenmpi-dev (as root)" >&2
    exit 1
  fi
  echo "fanstore-fuse: installing Debian packages: openmpi-bin libopenmpi-dev"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends openmpi-bin libopenmpi-dev >/dev/null
fi
test -x "$venv/bin/python" || python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip wheel
ompi=$(mpicc.openmpi --showme:version 2>&1 | sed -n 's/.*Open MPI \([0-9][0-9.]*\).*/\1/p')
py=$("$venv/bin/python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
wheels=${FANSTORE_WHEEL_CACHE:-$HOME/.cache/fanstore-fuse}/mpi4py-openmpi-${ompi:-unknown}-$py
if ! ls "$wheels"/mpi4py-*.whl >/dev/null 2>&1; then
  echo "fanstore-fuse: building mpi4py against Open MPI $ompi into $wheels (once; minutes)"
  mkdir -p "$wheels.tmp"
  MPICC=mpicc.openmpi "$venv/bin/pip" wheel --quiet --no-deps --no-binary mpi4py 'mpi4py>=4.0' \
    -w "$wheels.tmp"
  rm -rf "$wheels" && mv "$wheels.tmp" "$wheels"
fi
# The mpich wheel of an earlier install would put hydra's mpiexec into this venv: not here.
"$venv/bin/pip" uninstall --quiet -y mpich 2>/dev/null || true
"$venv/bin/pip" install --quiet --force-reinstall --no-deps --no-index --find-links "$wheels" mpi4py
"$venv/bin/pip" install --quiet -e ".[$extras]"
"$venv/bin/python" -c 'from fanstore_fuse import _mpilib as m; l = m.library(); print(f"mpi4py: {l.name}, {m.mpiexec(l).cmd[0]}"); assert l.family == m.OPEN_MPI, l.name'
