#!/usr/bin/env bash
# Install pyfuse3 3.5.0 with scripts/pyfuse3/pyfuse3-3.5.0-public-api.patch into a venv.
#   install-pyfuse3.sh VENV_PYTHON
# Downloads the pyfuse3 3.5.0 source distribution from the package index (pip download),
# checks its sha256, applies the patch (public API only: FileInfo.noflush and .cache_readdir,
# opendir returning a FileInfo, Operations.inode_fh_without_open, .enable_atomic_o_trunc and
# .enable_readdirplus_auto, ReaddirToken.plus, get_session_fd;
# see scripts/pyfuse3/README.md) and pip-installs it; Cython runs at build time.
# Skips when VENV_PYTHON's pyfuse3 already has Operations.inode_fh_without_open, unless it is
# a build of another revision of the patch (PYFUSE3_PATCH_FORCE=1 rebuilds anyway). Needs a C
# compiler, pkg-config and libfuse3-dev (scripts/install-deps.sh). CFLAGS in the environment
# reach the compiler and the linker (make test-sanitize builds with -Werror and the sanitizers
# that way); PYFUSE3_SRC_OUT=DIR keeps a copy of the patched sources. On failure: one line
# on stderr, exit 1.
set -euo pipefail

VERSION=3.5.0
SHA256=88399a9494b88603230bba300f4ba9ad63fece5ed514ca3633d555a0c6a42b24
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PATCH="$HERE/pyfuse3/pyfuse3-$VERSION-public-api.patch"

die() { echo "install-pyfuse3: $*" >&2; exit 1; }

[ $# -eq 1 ] || die "usage: install-pyfuse3.sh VENV_PYTHON"
PY="$1"
[ -x "$PY" ] || die "$PY is not an executable Python"
[ -r "$PATCH" ] || die "patch missing: $PATCH"
# The installed version names the patch (3.5.0+publicapi.<8 hex of its sha256>);
# `pyfuse3==3.5.0` still matches it (PEP 440 ignores a local label when the specifier has none).
LOCAL_VERSION="$VERSION+publicapi.$(sha256sum "$PATCH" | cut -c1-8)"

# A build with sanitizers in CFLAGS (make test-sanitize) imports only with their runtimes
# preloaded: ASan must come first in the process.
PRELOAD=""
case " ${CFLAGS:-} " in *-fsanitize=*address*) PRELOAD="$("${CC:-gcc}" -print-file-name=libasan.so)" ;; esac
case " ${CFLAGS:-} " in *-fsanitize=*undefined*) PRELOAD="$PRELOAD $("${CC:-gcc}" -print-file-name=libubsan.so)" ;; esac
PRELOAD="${PRELOAD# }"

# The installed pyfuse3's version when it has the API, else nothing.
api_version() {
  env ${PRELOAD:+LD_PRELOAD="$PRELOAD" ASAN_OPTIONS=detect_leaks=0} "$PY" -c 'import importlib.metadata as m, pyfuse3
if hasattr(pyfuse3.Operations, "inode_fh_without_open"): print(m.version("pyfuse3"))' 2>/dev/null || true
}
if [ "${PYFUSE3_PATCH_FORCE:-0}" != 1 ]; then
  have="$(api_version)"
  # This patch's build, or a pyfuse3 that has the API without any patch of ours.
  if [ "$have" = "$LOCAL_VERSION" ] || { [ -n "$have" ] && [[ "$have" != *+publicapi* ]]; }; then
    exit 0
  fi
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/install-pyfuse3.XXXXXX")"
LOG="$WORK/log"
trap 'rm -rf "$WORK"' EXIT
# Run a step with its output in $LOG; on failure keep the log and say where it is.
step() {
  local what="$1"; shift
  if ! "$@" >>"$LOG" 2>&1; then
    local kept
    kept="$(mktemp "${TMPDIR:-/tmp}/install-pyfuse3.XXXXXX.log")"
    cp "$LOG" "$kept"
    local why
    why="$(grep -iE 'error|fail|fatal' "$LOG" | tail -n 1)"
    [ -n "$why" ] || why="$(grep -v '^[[:space:]]*$' "$LOG" | tail -n 1)"
    die "$what failed: $(echo "$why" | sed 's/^[[:space:]]*//' | cut -c1-200) (full output: $kept)"
  fi
}

# --no-binary pyfuse3 only: the build requirements (setuptools, setuptools_scm, Cython) may come
# as wheels (with `:all:` pip would compile Cython too, minutes).
step "pip download pyfuse3==$VERSION" \
  "$PY" -m pip download --quiet --no-deps --no-binary pyfuse3 "pyfuse3==$VERSION" -d "$WORK/dl"
SDIST="$WORK/dl/pyfuse3-$VERSION.tar.gz"
[ -f "$SDIST" ] || die "pip download did not leave $SDIST"
got="$(sha256sum "$SDIST" | cut -d' ' -f1)"
[ "$got" = "$SHA256" ] || die "sha256 of pyfuse3-$VERSION.tar.gz is $got, expected $SHA256"

step "unpacking the sdist" tar -xzf "$SDIST" -C "$WORK"
SRC="$WORK/pyfuse3-$VERSION"
if command -v patch >/dev/null 2>&1; then
  step "applying $PATCH" patch -p1 --forward --batch -d "$SRC" -i "$PATCH"
else
  step "applying $PATCH" git -C "$SRC" apply -p1 "$PATCH"
fi
# PYFUSE3_SRC_OUT=DIR: a copy of the patched source tree (pyfuse3's own tests are in its test/).
if [ -n "${PYFUSE3_SRC_OUT:-}" ]; then
  step "copying the patched source to $PYFUSE3_SRC_OUT" cp -a "$SRC" "$PYFUSE3_SRC_OUT"
fi
# The sdist ships the C file that Cython generated from the unpatched sources; without it the
# build has to run Cython on the patched ones.
rm -f "$SRC/src/pyfuse3/__init__.c"

# Build isolation: pip fetches the build requirements from the index. The version would come
# from PKG-INFO; set it so that the build never asks git.
step "pip install (build) of the patched pyfuse3" \
  env SETUPTOOLS_SCM_PRETEND_VERSION_FOR_PYFUSE3="$LOCAL_VERSION" \
  "$PY" -m pip install --no-cache-dir "$SRC"
[ "$(api_version)" = "$LOCAL_VERSION" ] ||
  die "after the build, pyfuse3 is not $LOCAL_VERSION with Operations.inode_fh_without_open"
echo "install-pyfuse3: installed pyfuse3 $LOCAL_VERSION (patched) into $("$PY" -c 'import sys; print(sys.prefix)')"
