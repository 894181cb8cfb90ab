#!/usr/bin/env bash
# Install the Debian packages fanstore-fuse needs, when missing and when we may (root).
#   install-deps.sh           fuse3, libfuse3-dev, pkg-config, squashfs-tools, squashfuse
#                             (and, as root, fio for bench/fio.py)
#   install-deps.sh --slurm   also slurm-wlm and munge (the test cluster, scripts/minicluster/)
# As root, `make install` asks for --slurm too, so that CI runs the `slurm` tests; as another
# user a missing Slurm is not an error (those tests skip and say why).
set -euo pipefail
need=()
command -v fusermount3 >/dev/null 2>&1 || need+=(fuse3)
pkg-config --exists fuse3 2>/dev/null || need+=(libfuse3-dev pkg-config)
command -v mksquashfs >/dev/null 2>&1 || need+=(squashfs-tools)
command -v squashfuse >/dev/null 2>&1 || need+=(squashfuse)
# fio: bench/fio.py only. Installed when we may, never a reason to fail.
if ! command -v fio >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ]; then need+=(fio); else echo "fanstore-fuse: fio missing (bench/fio.py skips it)" >&2; fi
fi
if [ "${1:-}" = "--slurm" ]; then
  for t in slurmctld slurmd srun; do command -v $t >/dev/null 2>&1 || { need+=(slurm-wlm); break; }; done
  command -v munged >/dev/null 2>&1 || need+=(munge)
  command -v nsenter >/dev/null 2>&1 || need+=(util-linux)
fi
if [ ${#need[@]} -eq 0 ]; then exit 0; fi
if [ "$(id -u)" -ne 0 ]; then
  echo "fanstore-fuse: missing Debian packages: ${need[*]} (run as root or install them)" >&2
  exit 1
fi
echo "fanstore-fuse: installing Debian packages: ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# --no-install-recommends: slurm-wlm's recommends pull in a mail server and more.
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
