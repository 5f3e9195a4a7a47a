#!/usr/bin/env bash
# The type stubs (kvbm_ext/__init__.pyi) against the built module: mypy's stubtest
# compares every public name, signature and default the stubs declare with what the
# extension reports at runtime, and fails on any difference.  Nothing needs an
# allowlist: every C function and method carries its text signature.  The README's
# signatures are generated from these stubs (tools/readme.py api; tests/test_docs.py).
#
#   tools/stubtest.sh          # from any directory; needs the extension built here
set -euo pipefail
cd "$(dirname "$0")/.."

MYPY_CACHE_DIR="$(mktemp -d)"
export MYPY_CACHE_DIR
trap 'rm -rf "$MYPY_CACHE_DIR"' EXIT
python3 -c "import kvbm_ext, os, sys; sys.exit(0 if os.path.samefile(os.path.dirname(os.path.dirname(kvbm_ext.__file__)), '.') else 'stubtest: kvbm_ext is imported from ' + kvbm_ext.__file__ + ', not from this checkout')"
python3 -m mypy.stubtest kvbm_ext "$@"
