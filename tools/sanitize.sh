#!/usr/bin/env bash
# The CPU test suite under AddressSanitizer and UndefinedBehaviorSanitizer.
#
# Builds a CPU-only copy of the extension (no nvcc: the sanitizers do not see
# into CUDA kernels; compute-sanitizer does that on a GPU machine) with
# -fsanitize=address,undefined into a temporary directory (UBSan aborting on
# its first report; -fno-wrapv undoes the -fwrapv of CPython's own flags, which
# would make signed overflow defined and so invisible), then runs the
# tests against it with libasan preloaded (CPython itself is not built with
# it) and PYTHONMALLOC=malloc, so that every Python allocation goes through
# ASan too.  Exits non-zero on any test failure or sanitizer report.
#
#   tools/sanitize.sh                        # the whole CPU suite but the builds
#   tools/sanitize.sh tests/test_hostile.py  # some files
#   tools/sanitize.sh -m "not slow and not build" tests   # the quick selection
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cp -r "$root/csrc" "$root/cuda" "$root/kvbm_ext" "$root/setup.py" "$root/pyproject.toml" "$root/README.md" "$root/LICENSE" "$root/CHANGELOG.md" "$root/.clang-format" "$work/"
rm -f "$work"/kvbm_ext/*.so
flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-wrapv -fno-omit-frame-pointer -g"
(cd "$work" && PATH=/usr/bin:/bin CUDA_HOME=/nonexistent CUDA_PATH=/nonexistent CFLAGS="$flags" LDFLAGS="$flags" \
    python3 setup.py build_ext --inplace > build.log 2>&1) || { tail -30 "$work/build.log"; exit 1; }
cd "$work"
cp -r "$root/tests" "$root/tools" "$root/benchmarks" "$root/examples" "$root/docs" "$work/"
export LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export PYTHONMALLOC=malloc
# Tests marked build compile their own copy of the sources with the plain compilers
# (nothing of kvbm_ext runs under the sanitizers there): the plain suite runs them.
# A -m among the arguments replaces this one.
python3 -m pytest -q -p no:cacheprovider -m "not build" "${@:-tests}"
