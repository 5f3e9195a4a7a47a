#!/usr/bin/env bash
# The GPU tests (and benchmark) of kvbm_ext.integrations.vllm on the GPU machine, from the
# folder tools/vllm_gpu_carry.sh makes (as DIR/run-gpu-tests.sh): no network,
# Python 3.12, torch 2.11 (the one vLLM 0.26.0 pins, so vLLM 0.26.0's files are carried).
#
#   bash .carry-vllm/run-gpu-tests.sh [SRC] [OUT]
#
# SRC: the source tree with the integration (default: the repository root this runs in).
# OUT: where the benchmark's CSV, log and PNG go (default: $OUT, else no benchmark).
set -euo pipefail
CARRY=$(cd "$(dirname "$0")" && pwd)
SRC=$(cd "${1:-$PWD}" && pwd)
RESULTS=${2:-${OUT:-}}
SITE=/tmp/kvbm-vllm-site

# vLLM's pure-Python files (no .so: vllm/_C_stable_libtorch.py is an empty stand-in for the
# compiled ops vllm/platforms/cuda.py imports) and the packages it imports that the GPU
# machine lacks, into a folder of their own put first on PYTHONPATH; torch stays the machine's.
rm -rf "$SITE" && mkdir -p "$SITE"
python3 -m pip install -q --no-index --no-deps --target "$SITE" "$CARRY"/wheels/*.whl
python3 -m zipfile -e "$CARRY/vllm-0.26.0-py.zip" "$SITE"
# vLLM inspects a model's architecture by importing its module in a subprocess, which on
# CUDA needs the compiled flash-attention library; its model-info cache, made where the
# folder was made, answers instead.
rm -rf /tmp/kvbm-vllm-cache && cp -r "$CARRY/vllm-cache" /tmp/kvbm-vllm-cache
export PYTHONPATH="$SITE:$SRC" HF_HUB_OFFLINE=1 VLLM_CACHE_ROOT=/tmp/kvbm-vllm-cache

cd "$SRC"
CUDA_ARCHS=90 python3 setup.py -q build_ext --inplace > /tmp/kvbm-build.log 2>&1 || { tail -30 /tmp/kvbm-build.log; exit 1; }
python3 -c "import vllm, torch, kvbm_ext; print('vLLM', vllm.__version__, 'torch', torch.__version__, 'kvbm_ext', kvbm_ext.__version__, kvbm_ext.build_info().get('cuda'))"
python3 -m pytest tests/test_vllm_offload.py -q -rs -p no:cacheprovider
if [ -n "$RESULTS" ]; then
    python3 benchmarks/vllm_offload.py --out "$RESULTS"
fi
