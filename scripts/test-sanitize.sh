#!/usr/bin/env bash
# make test-sanitize: the native code this project ships, built with warnings as errors and run
# under AddressSanitizer and UBSan.
#   test-sanitize.sh [PYTHON]          (PYTHON makes the throwaway venv; default python3)
# 1. The package has no native code: any C, C++ or Cython source, object or compiled extension
#    under src/ (or an extension module declared in pyproject.toml) fails this target, so native
#    code cannot come back without this script being extended to build, sanitize and fuzz it.
# 2. The only native change is scripts/pyfuse3's patch to pyfuse3 3.5.0. It is built from the
#    sdist with CFLAGS="-Werror -fsanitize=address,undefined -fno-omit-frame-pointer" (Python's
#    own CFLAGS add -Wall; the Cython-generated code builds clean with gcc 12) into a throwaway
#    venv ($SANITIZE_VENV, default /tmp/fanstore-sanitize-venv, remade every run), through
#    scripts/install-pyfuse3.sh. Then tests/test_pyfuse3_api.py (real mounts of a tiny pyfuse3
#    file system using the patch's API) and pyfuse3's own tests (the patch's new ones included)
#    run on it with libasan and libubsan preloaded. Every report goes to a file in a log
#    directory; any file there fails the target, as does a failed test. A self-test first
#    checks that a heap overflow is reported there (so a preload that silently does nothing
#    cannot pass). Leak detection is off: CPython keeps objects alive until exit by design.
# The patch adds no parser of outside input (two setters of fuse_file_info bits), so there is
# nothing to fuzz natively; hostile manifests, frames and messages are fuzzed in the Python
# tests (tests/test_hostile.py, tests/test_messages.py). About 1 minute.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_PY="${1:-python3}"
VENV="${SANITIZE_VENV:-/tmp/fanstore-sanitize-venv}"
CC="${CC:-gcc}"
die() { echo "test-sanitize: $*" >&2; exit 1; }

# 1. no native code in the package
native="$(find src \( -name '*.c' -o -name '*.h' -o -name '*.cc' -o -name '*.cpp' -o -name '*.cxx' \
  -o -name '*.hpp' -o -name '*.pyx' -o -name '*.pxd' -o -name '*.pxi' -o -name '*.so' -o -name '*.o' \
  -o -name '*.a' -o -name '*.pyd' \) -print)"
[ -z "$native" ] || die "native code under src/ (build it with -Werror under ASan/UBSan here first): $(echo $native)"
if grep -nE 'ext[-_]modules|Extension\(' pyproject.toml setup.py setup.cfg 2>/dev/null; then
  die "an extension module is declared (above): build it with -Werror under ASan/UBSan here first"
fi
echo "test-sanitize: no native code under src/"

# 2. the patched pyfuse3 under the sanitizers
asan="$("$CC" -print-file-name=libasan.so)"
ubsan="$("$CC" -print-file-name=libubsan.so)"
[ -e "$asan" ] && [ -e "$ubsan" ] || die "$CC has no libasan.so/libubsan.so (got '$asan', '$ubsan')"
rm -rf "$VENV"
"$BASE_PY" -m venv "$VENV"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/fanstore-sanitize.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
"$VENV/bin/python" -m pip install --quiet 'pytest>=8' 'pytest-trio>=0.8' 'pytest-timeout>=2.3' \
  >"$WORK/pip.log" 2>&1 || { tail -n 5 "$WORK/pip.log"; die "pip install of pytest into $VENV failed"; }
CFLAGS="-Werror -fsanitize=address,undefined -fno-omit-frame-pointer" PYFUSE3_PATCH_FORCE=1 \
  PYFUSE3_SRC_OUT="$WORK/pyfuse3-src" bash scripts/install-pyfuse3.sh "$VENV/bin/python"
ext="$(find "$VENV" -path '*/site-packages/pyfuse3/*.so' -print -quit)"
[ -n "$ext" ] || die "no compiled pyfuse3 extension in $VENV"
# ldd's output goes to a file first: `ldd | grep -q` under pipefail fails whenever grep exits
# at its match before ldd has written the rest (SIGPIPE).
ldd "$ext" >"$WORK/ldd.txt" || die "ldd $ext failed"
grep -q libasan "$WORK/ldd.txt" && grep -q libubsan "$WORK/ldd.txt" || die "$ext is not linked with libasan and libubsan"

LOGS="$WORK/reports"
mkdir -p "$LOGS"
run() {
  env LD_PRELOAD="$asan $ubsan" \
    ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:log_path=$LOGS/asan" \
    UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$LOGS/ubsan" "$@"
}
reports() { find "$LOGS" -type f | sort; }

# self-test: a heap overflow made through ctypes must leave a report
run "$VENV/bin/python" -c 'import ctypes
libc = ctypes.CDLL(None); libc.malloc.restype = ctypes.c_void_p
ctypes.string_at(libc.malloc(8), 64)' >/dev/null 2>&1 || true
[ -n "$(reports)" ] && grep -q 'heap-buffer-overflow' $(reports) ||
  die "self-test: a heap overflow left no AddressSanitizer report in $LOGS"
rm -f "$LOGS"/*

status=0
run "$VENV/bin/python" -m pytest -q -p no:cacheprovider --noconftest tests/test_pyfuse3_api.py || status=1
(cd "$WORK/pyfuse3-src/test" && run "$VENV/bin/python" -m pytest -q -p no:cacheprovider --installed .) || status=1
if [ -n "$(reports)" ]; then
  for f in $(reports); do echo "== $f"; head -n 60 "$f"; done
  die "sanitizer reports above"
fi
[ "$status" = 0 ] || die "tests failed under the sanitizers (above)"
echo "test-sanitize: pyfuse3 (patched, -Werror, ASan+UBSan) passed its tests and ours with no report"
