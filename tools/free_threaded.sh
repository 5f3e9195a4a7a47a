#!/usr/bin/env bash
# The CPU suite on free-threaded CPython 3.13 (python3.13t, no GIL), then the thread
# stress under ThreadSanitizer.
#
# Unpacks the shared interpreter (../shared/python/cpython-3.13.5t-linux-x86_64.tar.xz
# beside the checkout; KVBM_FT_PYTHON names another) into a temporary directory, makes a
# venv there with numpy, pytest and setuptools from the package index, and builds a
# CPU-only copy of the extension (no nvcc: the suite's CPU tests need no kernels, and the
# build takes seconds).  Then:
#   1. importing kvbm_ext leaves the GIL off (an error if it warns or turns it on);
#   2. pytest over tests/ with tools/without_torch.py: torch has no wheel for this
#      interpreter, so the files that import it are reported skipped and the others run
#      (today test_free_threaded, test_fuzz, test_cli, test_packaging, test_readme, with
#      the tests of theirs that need torch or a GPU skipped); test_bench.py and
#      test_bench_units.py are left out, since every script they run imports torch.
#      The stress runs KVBM_EXT_STRESS_SECONDS
#      (default 30) with 16 threads;
#   3. the stress again, 16 threads for the same time, against a copy built with
#      -fsanitize=thread, libtsan preloaded: any report fails the run.
#
# ThreadSanitizer and an interpreter that is not built with it: TSan sees only what the
# instrumented extension does, plus the libc calls it intercepts.  Those the interpreter
# makes (malloc, free and memcpy inside mimalloc, QSBR, list and dict internals) are
# ordered by its own atomics, which TSan cannot see: they are reported as races (a dozen
# in a few seconds) that say nothing about kvbm_ext.  ignore_noninstrumented_modules=1
# drops the interceptor calls made from every module that is not instrumented (the
# interpreter, its extension modules, NumPy) and keeps every access the extension makes,
# its own memcpy calls included.  lock.h tells TSan about the PyMutex, whose slow path
# runs inside the interpreter.  tools/tsan.supp drops the reports on the extension's
# tp_traverse functions, which the garbage collector calls with every other thread
# stopped, a stop TSan cannot see either.  Taking the type-facts lock out makes this run
# report the races on the cache: what it reports is about kvbm_ext.  What it cannot see
# is a race between kvbm_ext and the interpreter itself.
#
#   tools/free_threaded.sh
#   KVBM_EXT_STRESS_SECONDS=5 tools/free_threaded.sh     # a shorter stress
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
archive="${KVBM_FT_PYTHON:-$root/../shared/python/cpython-3.13.5t-linux-x86_64.tar.xz}"
if [ ! -f "$archive" ]; then
    echo "free-threaded tests SKIPPED: no free-threaded interpreter at $archive"
    exit 0
fi
seconds="${KVBM_EXT_STRESS_SECONDS:-30}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

tar xJf "$archive" -C "$work"
"$work/cpython-3.13t/bin/python3.13t" -m venv "$work/venv"
py="$work/venv/bin/python"
# Wheels only: a newer NumPy whose cp313t wheels are not out yet would build from source.
"$py" -m pip install -q --only-binary=:all: numpy pytest setuptools

# A copy of the tree per build, CPU-only (PATH without nvcc, no CUDA_HOME).
build() {
    local tree="$1" flags="$2"
    mkdir -p "$tree"
    cp -r "$root/csrc" "$root/cuda" "$root/kvbm_ext" "$root/setup.py" "$root/pyproject.toml" "$root/README.md" \
        "$root/LICENSE" "$root/tests" "$root/tools" "$root/benchmarks" "$root/examples" \
        "$root/docs" "$root/CHANGELOG.md" "$tree/"
    rm -f "$tree"/kvbm_ext/*.so
    (cd "$tree" && PATH=/usr/bin:/bin CUDA_HOME=/nonexistent CUDA_PATH=/nonexistent CFLAGS="$flags" \
        LDFLAGS="$flags" "$py" setup.py build_ext --inplace > build.log 2>&1) || { tail -30 "$tree/build.log"; exit 1; }
}

build "$work/plain" ""
cd "$work/plain"
"$py" -W error::RuntimeWarning -c 'import sys, kvbm_ext
assert not sys._is_gil_enabled(), "importing kvbm_ext turned the GIL on"
print("kvbm_ext", kvbm_ext.__version__, "imported on", sys.version.split()[0], "free-threaded: GIL off")'
# PYTHONPATH: the tests' child interpreters (the fuzzer's workers) import this build too.
KVBM_EXT_STRESS_SECONDS="$seconds" PYTHONPATH="$PWD:$PWD/tools" "$py" -m pytest -p without_torch --noconftest \
    -p no:cacheprovider -q -rs --ignore=tests/test_bench.py --ignore=tests/test_bench_units.py tests

build "$work/tsan" "-fsanitize=thread -g -O1 -fno-omit-frame-pointer"
cd "$work/tsan"
status=0
LD_PRELOAD="$(gcc -print-file-name=libtsan.so)" \
    TSAN_OPTIONS="ignore_noninstrumented_modules=1 suppressions=tools/tsan.supp halt_on_error=0 exitcode=66" \
    "$py" -X faulthandler tests/test_free_threaded.py --threads 16 --seconds "$seconds" > stress.json || status=$?
case $status in
    0) ;;
    66) echo "ThreadSanitizer reported races (above)"; exit 1 ;;
    *) echo "the stress under ThreadSanitizer failed (exit status $status):"; cat stress.json; exit 1 ;;
esac
"$py" - <<'EOF'
import json
result = json.load(open("stress.json"))
assert not result["gil_enabled"], "the GIL was on during the stress"
print(f"ThreadSanitizer: no report; {result['threads']} threads x {result['seconds']:g} s, "
      f"{sum(result['calls'].values())} operations, all bitwise right, GIL off")
EOF
