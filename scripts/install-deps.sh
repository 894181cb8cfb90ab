#!/usr/bin/env bash
# Install the Debian packages fanstore-fuse needs, when missing and when we may (root).
set -euo pipefail
need=()
command -v fusermount3 >/dev/null 2>&1 || need+=(fuse3)
pkg-config --exists fuse3 2>/dev/null || need+=(libfuse3-dev pkg-config)
command -v mksquashfs >/dev/null 2>&1 || need+=(squashfs-tools)
command -v squashfuse >/dev/null 2>&1 || need+=(squashfuse)
if [ ${#need[@]} -eq 0 ]; then exit 0; fi
if [ "$(id -u)" -ne 0 ]; then
  echo "fanstore-fuse: missing Debian packages: ${need[*]} (run as root or install them)" >&2
  exit 1
fi
echo "fanstore-fuse: installing Debian packages: ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq "${need[@]}" >/dev/null
